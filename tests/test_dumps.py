"""`plan --dump-ir DIR` and `--dump-cp-model DIR`: what they write, that it reads back into what the
search used, that a failed search still leaves them, and that they change nothing in the plan."""

from __future__ import annotations

import json

import pytest
from ortools.sat.python import cp_model

from backends.report.terminal import warnings_section
from planner.api import PlanOptions, RunControls, plan
from planner.cli import main
from planner.core.errors import PlanningError
from planner.core.ir import Plan
from planner.core.units import NS_PER_S
from planner.dumps import CANDIDATES_FILE, COSTED_PROBLEM_FILE, load_costed_problem
from planner.search import ilp
from planner.search.configs import build_configs
from planner.search.solver import SolverSettings, make_solver
from tests.helpers import CLUSTERS, EXAMPLES

GPT = EXAMPLES / "gpt" / "model.py"
CLUSTER = CLUSTERS / "cpu-hetero-4.yaml"
PASSES = ["meta_shapes", "annotate", "saved", "blocks"]
OPTIONS = PlanOptions(global_batch=8, runners_up=False)


def test_dump_ir_writes_each_pass_and_the_costed_problem_and_changes_no_plan(tmp_path):
    dump = tmp_path / "ir"
    dumped = plan(GPT, CLUSTER, OPTIONS, RunControls(dump_ir_dir=dump))
    assert dumped.plan.to_json() == plan(GPT, CLUSTER, OPTIONS).plan.to_json()
    passes = [f"{i + 1:03d}_{name}.txt" for i, name in enumerate(PASSES)]
    assert sorted(p.name for p in dump.iterdir()) == sorted([*passes, CANDIDATES_FILE, COSTED_PROBLEM_FILE])

    shapes, costs, kept, blocks = ((dump / name).read_text() for name in passes)
    # each pass's records show from its own dump on: values first, costs after annotate, kept bytes after saved,
    # blocks last
    assert "\ninput_ids: val=int64[2, 32]\n" in shapes and "hetplan.cost=" not in shapes    # the trace batch: 2
    assert "hetplan.cost=OpCount(op_class='matmul'" in costs and "hetplan.kept_bytes" not in costs
    assert "hetplan.kept_bytes=Kept(values=" in kept and "hetplan.blocks" not in kept
    assert f"hetplan.blocks: {len(dumped.blocks)} items" in blocks and "hetplan.block=0" in blocks
    assert blocks.startswith("# after pass 4 `blocks` (modified: True)\ngraph():")

    # the costed problem is every number the search reads: it reads back equal to the tables (the
    # compression table too), and the search run on the file alone finds the plan's objective
    tables = load_costed_problem(dump / COSTED_PROBLEM_FILE)
    assert tables == dumped.tables
    configs = build_configs(tables)
    best = ilp.solve_regimes(tables, configs, SolverSettings(work_limit_s=OPTIONS.time_limit_s))[0]
    assert best.objective_s == dumped.plan.solver.objective_s
    doc = json.loads((dump / COSTED_PROBLEM_FILE).read_text())
    assert doc["search_options"]["strategy"] == "ilp" and "dump_dir" not in doc["search_options"]["solver"]
    candidates = (dump / CANDIDATES_FILE).read_text().splitlines()
    assert candidates[0] == f"{len(configs)} candidate configurations"
    assert len(candidates) == 4 + len(configs)          # count, blank line, header, rule, one per config


def test_pass_timings_come_from_the_pass_manager(tmp_path):
    result = plan(GPT, CLUSTER, OPTIONS)
    assert list(result.pass_timings_s) == PASSES
    assert all(t >= 0 for t in result.pass_timings_s.values())
    assert sum(result.pass_timings_s.values()) <= result.timings_s["trace_s"]   # the passes run inside tracing
    assert list(result.timings_s) == ["load_s", "trace_s", "cost_s", "search_s", "comm_s", "total_s"]


def test_a_failed_search_still_leaves_its_dumps(tmp_path):
    dump = tmp_path / "ir"
    with pytest.raises(PlanningError):
        plan(GPT, CLUSTER, PlanOptions(global_batch=8, stages=64), RunControls(dump_ir_dir=dump))
    assert (dump / "004_blocks.txt").is_file() and (dump / COSTED_PROBLEM_FILE).is_file()
    assert (dump / CANDIDATES_FILE).read_text().startswith("0 candidate configurations")


def test_cli_dumps_load_back_and_leave_plan_json_byte_identical(tmp_path, capsys):
    args = [str(GPT), "--cluster", str(CLUSTER), "--global-batch", "8"]
    ir, cp = tmp_path / "ir", tmp_path / "cp"
    assert main([*args, "-o", str(tmp_path / "dumped"), "--dump-ir", str(ir), "--dump-cp-model", str(cp)]) == 0
    assert main([*args, "-o", str(tmp_path / "plain")]) == 0
    printed = capsys.readouterr().out
    plan_bytes = (tmp_path / "dumped" / "plan.json").read_bytes()
    assert plan_bytes == (tmp_path / "plain" / "plan.json").read_bytes()
    assert (ir / COSTED_PROBLEM_FILE).is_file()

    # every CP-SAT model the search solved, in CP-SAT's text format (tensor-parallel and ZeRO variants in
    # folders of their own): each loads back into a CpModel, and solved with the project's settings the best
    # of them is the plan's objective
    assert sorted(p.name for p in cp.glob("*.pbtxt")) == ["one-node.pbtxt", "spread.pbtxt"]
    objectives = []
    for path in sorted(cp.rglob("*.pbtxt")):
        model = cp_model.CpModel()
        model.proto.parse_text_format(path.read_text())
        assert len(model.proto.variables) > 0 and model.proto.has_objective()
        solver = make_solver(SolverSettings(work_limit_s=10.0))
        assert solver.solve(model) == cp_model.OPTIMAL
        objectives.append(solver.objective_value)
    solved = json.loads(plan_bytes)["solver"]
    assert min(objectives) == pytest.approx(solved["objective_s"] * NS_PER_S, abs=0.5)

    # planning time per phase and per pass: in solve.json, and under the summary
    timings = json.loads((tmp_path / "plain" / "solve.json").read_text())
    assert list(timings["passes_s"]) == sorted(PASSES) and timings["total_s"] >= timings["trace_s"]
    summary = (tmp_path / "plain" / "summary.txt").read_text()
    # the terminal shows the plan's warnings on stderr (here the catalog's placeholder CPU figures), the file holds them
    shown = summary.replace("\n" + warnings_section(Plan.load(tmp_path / "plain")), "")
    assert "planning time: load" in summary and "passes: meta_shapes" in summary and shown in printed


def test_a_dump_folder_inside_the_output_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    code = main([str(GPT), "--cluster", str(CLUSTER), "-o", str(out), "--dump-ir", str(out / "ir")])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dump-ir" in err[0] and "inside the output directory" in err[0]


def test_a_folder_of_the_users_is_refused_before_planning_and_left_as_it_was(tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / CANDIDATES_FILE).write_text("mine\n")
    out = tmp_path / "out"
    code = main([str(GPT), "--cluster", str(CLUSTER), "-o", str(out), "--dump-ir", str(notes)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dump-ir" in err[0] and "--force" in err[0]
    assert [p.name for p in notes.iterdir()] == [CANDIDATES_FILE] and (notes / CANDIDATES_FILE).read_text() == "mine\n"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_a_dump_folder_holding_the_output_is_refused(tmp_path, capsys):
    code = main([str(GPT), "--cluster", str(CLUSTER), "-o", str(tmp_path / "d" / "out"),
                 "--dump-cp-model", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dump-cp-model" in err[0] and "holds the output directory" in err[0]
    assert not (tmp_path / "d").exists()


def test_an_earlier_dump_is_replaced_whole_and_a_failed_search_leaves_its_own(tmp_path, capsys):
    ir = tmp_path / "ir"
    args = [str(GPT), "--cluster", str(CLUSTER), "--global-batch", "8", "--no-runners-up", "--dump-ir", str(ir)]
    assert main([*args, "-o", str(tmp_path / "out")]) == 0
    (ir / "099_stale.txt").write_text("a file of an earlier dump")
    planned = (ir / CANDIDATES_FILE).read_text()
    # the same folder again, for a search that finds no plan: its dumps replace the earlier ones whole
    assert main([*args, "-o", str(tmp_path / "out2"), "--stages", "64"]) == 3      # no plan
    capsys.readouterr()
    assert not (tmp_path / "out2").exists() and not (ir / "099_stale.txt").exists()
    assert (ir / "004_blocks.txt").is_file() and (ir / COSTED_PROBLEM_FILE).is_file()
    assert (ir / CANDIDATES_FILE).read_text().startswith("0 candidate configurations") != planned.startswith("0 ")
    # --dump-ir and --dump-cp-model naming one folder share it; with --force a folder of other files is replaced
    both = tmp_path / "both"
    both.mkdir()
    (both / "old.txt").write_text("x")
    assert main([*args[:-1], str(both), "--dump-cp-model", str(both), "-o", str(tmp_path / "out3"), "--force"]) == 0
    names = {p.name for p in both.iterdir()}
    assert "old.txt" not in names and {"004_blocks.txt", COSTED_PROBLEM_FILE, "spread.pbtxt"} <= names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both", "ir", "out", "out3"]   # no temporary sibling left
