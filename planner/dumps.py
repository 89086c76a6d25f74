"""What `plan --dump-ir DIR` writes besides the graph after each pass (passes.base.PassManager): the
costed problem the search reads, and the candidate configurations it chooses among.

`costed_problem.json` holds every number of the cost tables (each device class's per-block times and
bytes, the network, the tied weights, the compression table) and the search's options: the search
sees nothing else of the model or the spec, so the file alone replays it (`load_costed_problem`).
`candidates.txt` lists the replica shapes the search was offered, one line each. Both are written
before the search runs, so a failed search (no plan) still leaves them for a bug report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from backends.report.text import format_time, table
from costmodel.compression import CompressedCostTables, CompressionTable, compression_of
from costmodel.tables import ClassTable, CostTables
from planner.core.blocks import BlockSharding
from planner.search.candidates import Config
from planner.search.options import SearchOptions

COSTED_PROBLEM_FILE = "costed_problem.json"
CANDIDATES_FILE = "candidates.txt"
COSTED_PROBLEM_VERSION = 1


def write_costed_problem(folder: Path, tables: CostTables, options: SearchOptions) -> Path:
    """Write `tables` and `options` to `folder/costed_problem.json` (floats exact: JSON keeps repr)."""
    solver = {k: v for k, v in dataclasses.asdict(options.solver).items() if k != "dump_dir"}
    doc = {
        "version": COSTED_PROBLEM_VERSION,
        "search_options": {**dataclasses.asdict(options), "solver": solver},
        "tables": {f.name: _plain(getattr(tables, f.name)) for f in dataclasses.fields(CostTables)},
        "compression": dataclasses.asdict(compression_of(tables)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / COSTED_PROBLEM_FILE
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load_costed_problem(path: Path) -> CompressedCostTables:
    """The cost tables of a `costed_problem.json`, equal to the ones that were written."""
    doc = json.loads(path.read_text())
    tables = dict(_tuples(doc["tables"]))
    tables["classes"] = tuple(ClassTable(**c) for c in tables["classes"])
    tables["shardings"] = tuple(BlockSharding(**b) for b in tables.get("shardings", ()))
    return CompressedCostTables(**tables, compression=CompressionTable(**_tuples(doc["compression"])))


def write_candidates(folder: Path, tables: CostTables, configs: list[Config]) -> Path:
    """One line per candidate configuration: its device classes, stages, micro-batch, schedule, slowest
    stage per micro-batch, the most micro-batches its memory holds, whether it sits in one node, its
    replica time with one micro-batch, and per stage whether it recomputes, and the split's bounds."""
    names = [c.name for c in tables.classes]
    rows = []
    for i, c in enumerate(configs):
        sp = c.split
        rows.append([str(i), "+".join(names[k] for k in dict.fromkeys(c.classes)), str(c.num_stages),
                     str(c.micro_batch), c.schedule, format_time(max(sp.stage_s)),
                     "any" if c.max_micro_batches is None else str(c.max_micro_batches),
                     "yes" if c.intra_node else "no", format_time(c.replica_time_s(1)),
                     "".join("r" if r else "-" for r in sp.stage_recompute), ",".join(map(str, sp.bounds))])
    # the two columns that grow with the stage count last, so the others stay readable
    header = ["config", "classes", "stages", "micro", "schedule", "slowest stage", "max micro", "one node",
              "time at M=1", "recompute", "bounds"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CANDIDATES_FILE
    path.write_text(f"{len(configs)} candidate configurations\n\n" + table(header, rows) + "\n")
    return path


def _plain(value: Any) -> Any:
    """A field of the tables for JSON: dataclasses (also inside tuples) as dicts."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _tuples(value: Any) -> Any:
    """JSON's lists back to the tuples the tables hold (every sequence in them is a tuple)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value
