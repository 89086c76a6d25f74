"""hetplan's planner: `from planner import plan, PlanOptions`."""

from __future__ import annotations

from typing import Any

__all__ = ["plan", "PlanOptions", "PlanResult", "Plan"]


def __getattr__(name: str) -> Any:
    # lazy: `plan --help` and error paths need not import torch
    if name in ("plan", "PlanOptions", "PlanResult"):
        from planner import api

        return getattr(api, name)
    if name == "Plan":
        from planner.core.ir import Plan

        return Plan
    raise AttributeError(name)
