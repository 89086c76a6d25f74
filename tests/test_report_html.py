"""The HTML report in a real headless Chromium: drawn, readable at 1024 devices, no console errors.

`HETPLAN_SCREENSHOT_DIR=docs python3 -m pytest tests/test_report_html.py` also writes the screenshot
of the 32-GPU report that the README shows (docs/report-seed-mixed-32.png).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from backends.report.html import render_html
from backends.report.svg import replica_groups
from backends.sim import simulate_plan
from planner.api import PlanOptions, plan
from planner.frontend.cluster import load_cluster

sys.path.insert(0, str(Path(__file__).parent))
from browser import Browser, chromium_path  # noqa: E402
from helpers import EXAMPLES  # noqa: E402

pytestmark = pytest.mark.slow
DRAWINGS = ("cluster-svg", "timeline-svg", "memory-svg")
MEASURE = ("JSON.stringify(Object.fromEntries(%s.map(id => { const el = document.getElementById(id); "
           "const box = el.getBoundingClientRect(); return [id, {width: box.width, height: box.height, "
           "rects: el.querySelectorAll('rect').length, visible: getComputedStyle(el).visibility}]; })))")


@pytest.fixture(scope="module")
def browser():
    path, why = chromium_path()
    if path is None:
        pytest.skip(f"headless Chromium unavailable: {why}")
    with Browser(path) as b:
        yield b


def _report(tmp_path: Path, model: str, cluster: str, batch: int) -> tuple[Path, object]:
    spec = load_cluster(EXAMPLES / "clusters" / f"{cluster}.yaml")
    result = plan(EXAMPLES / model / "model.py", spec, PlanOptions(global_batch=batch))
    out = tmp_path / f"{cluster}.html"
    out.write_text(render_html(result.plan, spec, simulate_plan(result.plan, spec)))
    return out, result.plan


def _measure(page) -> dict:
    return json.loads(page.evaluate(MEASURE % json.dumps(list(DRAWINGS))))


def test_the_32_gpu_report_draws_cluster_timeline_and_memory(browser, tmp_path, monkeypatch):
    monkeypatch.setenv("HETPLAN_SEQ_LEN", "1024")      # llama7b's sequence: a shorter trace, same layers
    path, planned = _report(tmp_path, "llama7b", "seed-mixed-32", 64)
    page = browser.open(path)
    assert page.errors == []
    drawn = _measure(page)
    assert all(d["visible"] == "visible" for d in drawn.values())
    assert drawn["cluster-svg"]["rects"] >= 32 + 8         # a cell per device, a box per node
    assert drawn["cluster-svg"]["width"] > 500 and drawn["cluster-svg"]["height"] > 100
    used = planned.world_size
    assert drawn["timeline-svg"]["rects"] >= used           # every rank's actions are bars
    assert drawn["timeline-svg"]["height"] >= 16 * used // planned.tp_degree   # a row per stage (its shards alike)
    assert drawn["memory-svg"]["rects"] >= 2 * used          # capacity and its parts per device
    width = drawn["timeline-svg"]["width"]
    page.evaluate("zoomTimeline(2)")
    assert _measure(page)["timeline-svg"]["width"] > 1.5 * width
    page.evaluate("zoomTimeline(0.5)")
    shot = tmp_path / "report.png"
    page.screenshot(shot)
    assert shot.stat().st_size > 20_000
    if os.environ.get("HETPLAN_SCREENSHOT_DIR"):
        target = Path(os.environ["HETPLAN_SCREENSHOT_DIR"]) / "report-seed-mixed-32.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)


def test_the_1024_gpu_report_stays_readable(browser, tmp_path):
    path, planned = _report(tmp_path, "llama70b", "large-1024", 1024)
    assert planned.world_size > 500
    page = browser.open(path)
    assert page.errors == []
    drawn = _measure(page)
    assert drawn["cluster-svg"]["rects"] >= 1024              # every device drawn
    # identical replicas share rows: far fewer rows than ranks, and the page stays a few screens long
    rows = sum(len(group.first.stages) for group in replica_groups(planned))
    assert rows < planned.world_size / 4
    assert 16 * rows <= drawn["timeline-svg"]["height"] < 16 * planned.world_size / 4
    assert page.evaluate("document.body.scrollHeight") < 20_000
    assert "identical replicas" in page.evaluate("document.getElementById('timeline').innerHTML")


def test_names_from_the_spec_are_text_not_markup(browser, tmp_path):
    spec_text = (EXAMPLES / "clusters" / "cpu-hetero-4.yaml").read_text().replace(
        "name: cpu-hetero-4", "name: '<script>window.pwned = 1</script> <b>x</b>'")
    spec_path = tmp_path / "hostile.yaml"
    spec_path.write_text(spec_text)
    spec = load_cluster(spec_path)
    result = plan(EXAMPLES / "mlp" / "model.py", spec, PlanOptions(global_batch=8, runners_up=False))
    out = tmp_path / "hostile.html"
    out.write_text(render_html(result.plan, spec, simulate_plan(result.plan, spec)))
    page = browser.open(out)
    assert page.evaluate("typeof window.pwned") == "undefined"
    assert page.evaluate("document.querySelectorAll('b').length") == 0
    assert "<script>window.pwned = 1</script>" in page.evaluate("document.querySelector('h1').innerText")


def test_plan_inspect_html_writes_one_self_contained_page(browser, tmp_path):
    from planner.cli.main import main

    out, page_path = tmp_path / "out", tmp_path / "report.html"
    assert main([str(EXAMPLES / "mlp" / "model.py"), "--cluster", str(EXAMPLES / "clusters" / "cpu-hetero-4.yaml"),
                 "--global-batch", "8", "-o", str(out)]) == 0
    assert main(["inspect", str(out), "--html", str(page_path)]) == 0
    text = page_path.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text  # no network
    page = browser.open(page_path)
    assert page.errors == []
    assert all(d["rects"] > 0 for d in _measure(page).values())
