"""ONNX backend: one .onnx file per distinct stage of a plan, each checked in onnxruntime.

    stages   the plan's stages as the program builds them: the model on CPU with real weights, traced at a
             micro-batch size of the plan and cut at its stage boundaries (passes.split)
    export   each stage's forward through `torch.onnx.export(..., dynamo=True)`, then run in onnxruntime on
             the torch stage's own inputs and compared with its outputs

`plan export OUT --onnx DIR` (planner/cli/export_cmd.py) is the command over it. The files are for
inspection and deployment of one stage's forward: static shapes (the traced micro-batch), parameters as
initializers, the values crossing the stage's boundaries as the graph's inputs and outputs (by the names
the plan gives them).
"""

from __future__ import annotations

from backends.onnx.export import StageFile, export_plan
from backends.onnx.stages import PlanStage, plan_stages

__all__ = ["PlanStage", "StageFile", "export_plan", "plan_stages"]
