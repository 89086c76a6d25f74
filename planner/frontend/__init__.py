"""Frontend: load the user's inputs (model file, cluster spec) and trace the model on meta tensors.

    model_file   load_model_file, example_batch, build_on_meta: the model file's contract
    user_code    the model file's code under a time limit, its exits and interrupts reported
    trace        trace: torch.export (non-strict) on meta, symbolic_trace as the fallback;
                 trace_model: planning's trace, the contract checked around it
    repeated, replicate   deep stacks of identical layers traced once and replicated
    cluster      load_cluster: spec.yaml -> planner.core.cluster records
"""

from __future__ import annotations

from planner.frontend.model_file import (
    DEFAULT_NAMES,
    ModelFile,
    build_on_meta,
    default_loss,
    example_batch,
    example_batch_for_step,
    load_model_file,
    to_device,
)
from planner.frontend.trace import trace, trace_model

__all__ = ["DEFAULT_NAMES", "ModelFile", "build_on_meta", "default_loss", "example_batch",
           "example_batch_for_step", "load_model_file", "to_device", "trace", "trace_model"]
