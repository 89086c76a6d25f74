"""Re-planning a plan's model on fewer devices or a new spec (`plan replan`): what is planned again.

The model is the copy the plan's program trained (`OUT/program/model.py`); the global batch and every
option are the plan's (`inputs.options`, read back into PlanOptions by `options_from_pairs`); the
cluster is the plan's spec less the devices it was already made without (`inputs.lost_devices`) and
those now lost, or a new spec (less those given). Lost devices keep their labels (ClusterSpec.without).

An option that named a device count must still make sense on what is left (`check_device_options`):
`--stages N` needs N devices, and N-stage pipelines must use them all under `--use-all-devices`
(`plan replan --stages N | --no-use-all-devices` override the plan's). Everything else (memory,
micro-batches) the search judges as it does for `plan`. The new plan records what it replaces
(`Lineage`, planner.core.plan_records).
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.core.cluster import ClusterSpec
from planner.core.errors import OptionError, PlanFileError
from planner.core.ir import Lineage, Plan
from planner.frontend.cluster import load_cluster
from planner.options import PlanOptions

_WORDS: dict[object, str] = {bool: "True or False", int: "a whole number", float: "a number"}
NAME_PREFIX = "name."      # PlanOptions.as_pairs writes `names` as name.ROLE


def options_from_pairs(pairs: Sequence[tuple[str, str]], source: str = "plan.json") -> PlanOptions:
    """The PlanOptions that PlanOptions.as_pairs wrote as `pairs` (each value as `str()` wrote it); raises
    PlanFileError naming `inputs.options` for a name or a value no PlanOptions has."""
    hints = typing.get_type_hints(PlanOptions)
    fields = {f.name for f in dataclasses.fields(PlanOptions)} - {"names"}
    values: dict[str, object] = {}
    names: dict[str, str] = {}
    for key, text in pairs:
        if key.startswith(NAME_PREFIX):
            names[key.removeprefix(NAME_PREFIX)] = text
        elif key in fields:
            values[key] = _parse(hints[key], text, key, source)
        else:
            raise PlanFileError(f"unknown option {key[:40]!r} in inputs.options", file=source,
                                field="inputs.options", fix="re-plan with `plan MODEL --cluster SPEC`")
    return PlanOptions(**values, names=names)  # type: ignore[arg-type]


def with_overrides(options: PlanOptions, overrides: Mapping[str, Any]) -> PlanOptions:
    """`options` with the fields `overrides` names replaced (`plan replan --stages`); an unknown name is an
    OptionError (the values are checked with every option, planner.options.check_options)."""
    known = {f.name for f in dataclasses.fields(PlanOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise OptionError(f"no option {unknown[0][:40]!r} to override", field="overrides",
                          fix=f"name PlanOptions fields: {', '.join(sorted(known))}")
    return dataclasses.replace(options, **overrides)


def _parse(tp: object, text: str, key: str, source: str) -> object:
    """`text` (what str() made of a value of type `tp`) as that value."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        if text == "None":
            return None
        tp = next(a for a in args if a is not type(None))
    try:
        if tp is bool:
            if text not in ("True", "False"):
                raise ValueError(text)
            return text == "True"
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise PlanFileError(f"option {key} is {text[:40]!r}, not {_WORDS.get(tp, str(tp))}", file=source,
                            field="inputs.options", fix="re-plan with `plan MODEL --cluster SPEC`") from None
    return text


def check_device_options(options: PlanOptions, spec: ClusterSpec, lost: Sequence[str]) -> None:
    """Raise OptionError when an option of the plan counts devices the cluster left no longer has:
    `--stages N` needs N devices, and with `--use-all-devices` every pipeline has N stages, so the devices
    left must be a multiple of N."""
    left = spec.num_devices
    where = f"the cluster less {', '.join(lost)}" if lost else "the new cluster"
    stages = options.stages
    if stages is not None and stages > left:
        raise OptionError(f"the plan was made with --stages {stages}; {where} has {left} device"
                          f"{'s' if left != 1 else ''}", field="--stages",
                          fix=f"re-plan with --stages N (N <= {left}), or --stages 0 to let the search choose")
    if stages is not None and options.use_all_devices and left % stages:
        raise OptionError(f"the plan was made with --use-all-devices and --stages {stages}; the {left} devices of "
                          f"{where} do not make pipelines of {stages} stages", field="--use-all-devices",
                          fix=f"re-plan with --no-use-all-devices, or --stages N with N dividing {left}")


def cluster_left(previous: Plan, without: Sequence[str], cluster: str | Path | None = None,
                 source: str = "plan.json") -> ClusterSpec:
    """The cluster to re-plan on: `cluster` (a new spec) less `without`, or the plan's spec less the devices
    it was made without and `without`. Raises OptionError (a label it does not have, none left) or
    SpecError/PlanFileError (the plan's spec is not there)."""
    if cluster is not None:
        return load_cluster(cluster).without(without)
    path = previous.inputs.cluster_path
    if not path or not Path(path).is_file():
        raise PlanFileError(f"the spec this plan was made for ({path or 'none recorded'}) is not there",
                            file=source, field="inputs.cluster_path",
                            fix="pass the spec with --cluster SPEC (and the devices lost with --without)")
    return load_cluster(path).without(previous.inputs.lost_devices).without(without)


def lineage(previous_file: Path, without: Sequence[str], spec: ClusterSpec) -> Lineage:
    """The record of what a re-planned plan replaces: the plan file `previous_file` and how it was left."""
    digest = hashlib.sha256(previous_file.read_bytes()).hexdigest()
    cluster = str(Path(spec.source_path).resolve()) if spec.source_path else ""
    return Lineage(plan_dir=str(previous_file.parent.resolve()), plan_digest=digest,
                   without=tuple(dict.fromkeys(without)), cluster=cluster)

