"""Real data for the program: the seeded epoch-wise selection, each replica reading only its own samples
through a DataLoader, ranks that need nothing reading nothing, the plan-time checks of dataset(), and
the token-file example (prepare.py's memmap, its dtype / vocabulary checks)."""

from __future__ import annotations

import datetime
import gc
import json
import multiprocessing
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from backends.torchdist.program import data, rows
from passes.split import split_stages
from planner import frontend
from planner.core.errors import ModelFileError
from planner.core.ir import Plan
from planner.frontend.model_file import check_dataset, load_dataset
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, spawn_gloo_workers

TOKENS = EXAMPLES / "tokens"
GLOBAL_BATCH = 16
CPU = torch.device("cpu")


def _prepare(folder: Path) -> Path:
    """The example's token file, written by its own prepare.py into `folder`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tokens_prepare", TOKENS / "prepare.py")
    assert spec is not None and spec.loader is not None
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    assert prepare.main(["--out", str(folder)]) == 0
    return folder / "tokens.bin"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    return _prepare(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def token_plan_dir(token_file, tmp_path_factory) -> Path:
    """The token example planned on cpu-hetero-4 as two uneven 2-stage replicas (the CLI, real CP-SAT)."""
    out = tmp_path_factory.mktemp("plan") / "out"
    previous = os.environ.get("HETPLAN_DATA")
    os.environ["HETPLAN_DATA"] = str(token_file)
    try:
        proc = run_plan_cli(str(TOKENS / "model.py"), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"),
                            "--global-batch", str(GLOBAL_BATCH), "--stages", "2", "--use-all-devices",
                            "--micro-batch", "4", "--no-runners-up", "-o", str(out))
    finally:
        if previous is None:
            os.environ.pop("HETPLAN_DATA")
        else:
            os.environ["HETPLAN_DATA"] = previous
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def token_plan(token_plan_dir) -> Plan:
    plan = Plan.load(token_plan_dir)
    assert len(plan.replicas) == 2 and any(len(r.micro_batch_sizes) > 1 for r in plan.replicas)
    return plan


def _recording_model(folder: Path, length: int) -> Path:
    """A model file whose dataset() of `length` samples records, in files under `folder`, that it was
    built (`built-PID`) and every index __getitem__ read (`reads-PID`, one per line, per process)."""
    path = folder / "recording.py"
    path.write_text(textwrap.dedent(f"""
        import os
        import torch
        from torch.utils.data import Dataset

        RECORDS = {str(folder)!r}

        class Recording(Dataset):
            def __init__(self):
                open(os.path.join(RECORDS, f"built-{{os.getpid()}}"), "w").close()

            def __len__(self):
                return {length}

            def __getitem__(self, i):
                with open(os.path.join(RECORDS, f"reads-{{os.getpid()}}"), "a") as f:
                    f.write(f"{{i}}\\n")
                return torch.full((3,), float(i)), torch.tensor(i)

        def dataset():
            return Recording()

        def model():
            return torch.nn.Linear(3, 1)

        def batch(batch_size, step):
            return (torch.zeros(batch_size, 3),), torch.zeros(batch_size, dtype=torch.long)
    """))
    return path


def _reads(folder: Path) -> dict[int, list[int]]:
    """Indices read, per reading process id."""
    return {int(p.name.split("-")[1]): [int(line) for line in p.read_text().split()]
            for p in folder.glob("reads-*")}


def test_selection_is_seeded_epoch_wise_and_drops_the_remainder():
    length, g = 37, 8                                  # 4 steps per epoch, 5 samples dropped each epoch
    a, b = rows.Selection(length, g, seed=5), rows.Selection(length, g, seed=5)
    steps = [a.global_indices(k) for k in range(12)]
    assert steps == [b.global_indices(k) for k in reversed(range(12))][::-1]   # any order of asking
    assert all(len(s) == g == len(set(s)) for s in steps)
    for epoch in range(3):
        epoch_steps = steps[epoch * 4:(epoch + 1) * 4]
        read = [i for s in epoch_steps for i in s]
        perm = torch.randperm(length, generator=torch.Generator().manual_seed(rows.epoch_seed(5, epoch)))
        assert read == perm[:32].tolist()              # consumed in order; the last 37 % 8 never read
    assert steps[0] != steps[4]                        # a new permutation each epoch
    assert rows.Selection(length, g, seed=6).global_indices(0) != steps[0]
    with pytest.raises(ValueError):
        rows.Selection(7, 8, seed=0)


def test_replica_slices_partition_the_global_batch(token_plan, token_file, monkeypatch):
    monkeypatch.setenv("HETPLAN_DATA", str(token_file))
    model_file = frontend.load_model_file(TOKENS / "model.py")
    dataset = load_dataset(model_file)
    selection = rows.Selection(len(dataset), GLOBAL_BATCH, seed=3)
    readers = [data.ReplicaData(model_file, token_plan, r.index, CPU, seed=3, steps=20, num_workers=1)
               for r in token_plan.replicas]
    try:
        for step in range(20):                          # past the first epoch's end (17 steps)
            indices = selection.global_indices(step)
            cut = [indices[a:b] for r in token_plan.replicas for a, b in rows.micro_slices(token_plan, r.index)]
            assert [i for part in cut for i in part] == indices
            assert [b - a for a, b in (s for r in token_plan.replicas
                                       for s in rows.micro_slices(token_plan, r.index))] == \
                [n for r in token_plan.replicas for n in r.micro_batch_sizes]
            inputs, target = data.global_rows(model_file, GLOBAL_BATCH, step, 3, dataset=dataset)
            micro = [mb for reader in readers for mb in reader.micro_batches(step)]
            assert torch.equal(torch.cat([mb.inputs[0] for mb in micro]), inputs[0])
            assert torch.equal(torch.cat([mb.target for mb in micro]), target)
            assert inputs[0].dtype == torch.int64 and inputs[0].shape == (GLOBAL_BATCH, 32)
            assert torch.equal(inputs[0][:, 1:], target[:, :-1])     # next-token windows
    finally:
        for reader in readers:
            reader.close()


def test_each_replica_reads_only_its_own_samples_in_loader_workers(token_plan, tmp_path):
    model_file = frontend.load_model_file(_recording_model(tmp_path, 50))
    selection = rows.Selection(50, GLOBAL_BATCH, seed=1)
    steps = 5                                           # 3 steps per epoch: crosses an epoch
    for replica in token_plan.replicas:
        for old in tmp_path.glob("reads-*"):
            old.unlink()
        reader = data.ReplicaData(model_file, token_plan, replica.index, CPU, seed=1, steps=steps)
        got = [reader.micro_batches(step) for step in range(steps)]
        assert multiprocessing.active_children()        # loader workers are running
        reader.close()
        assert not multiprocessing.active_children()    # and stopped
        start, stop = rows.rows_of_replica(token_plan, replica.index)
        mine = [i for step in range(steps) for i in selection.global_indices(step)[start:stop]]
        reads = _reads(tmp_path)
        assert os.getpid() not in reads and len(reads) == 2        # read by the two workers only
        assert sorted(i for found in reads.values() for i in found) == sorted(mine)   # each once, no other
        for step, micro in enumerate(got):
            assert [mb.rows for mb in micro] == list(replica.micro_batch_sizes)
            read = [int(v) for mb in micro for v in mb.target]
            assert read == selection.global_indices(step)[start:stop]
            assert torch.equal(torch.cat([mb.inputs[0][:, 0] for mb in micro]), torch.tensor(read).float())


def _loader_rank(rank: int, store_port: int, plan_dir: str, token_file: str, steps: int) -> None:
    """Rank `rank` of a gloo group reads replica `rank`'s rows through forked loader workers, checks them
    against one process's global rows, and sums its targets with the others' after every step."""
    os.environ["HETPLAN_DATA"] = token_file
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        plan = Plan.load(Path(plan_dir))
        model_file = frontend.load_model_file(TOKENS / "model.py")
        reader = data.ReplicaData(model_file, plan, rank, CPU, seed=7, steps=steps)
        start, stop = rows.rows_of_replica(plan, rank)
        for step in range(steps):
            mine = torch.cat([mb.target for mb in reader.micro_batches(step)])
            _, target = data.global_rows(model_file, plan.global_batch, step, 7)
            assert torch.equal(mine, target[start:stop]), (rank, step)
            total = mine.sum().double()
            dist.all_reduce(total)
            assert float(total) == float(target.sum()), (rank, step)
        reader.close()
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_loaders_in_gloo_ranks_read_the_replicas_rows(token_plan_dir, token_file):
    spawn_gloo_workers(_loader_rank, (str(token_plan_dir), str(token_file), 4), 2, deadline_s=180)


def test_a_rank_that_needs_nothing_reads_nothing(token_plan, tmp_path):
    model_file = frontend.load_model_file(_recording_model(tmp_path, 50))
    reader = data.ReplicaData(model_file, token_plan, 0, CPU, needs=rows.NOTHING, steps=3)
    micro = [reader.micro_batches(step) for step in range(3)]
    reader.close()
    assert not list(tmp_path.glob("built-*")) and not list(tmp_path.glob("reads-*"))   # dataset() not called
    assert not reader.reads_dataset and not multiprocessing.active_children()
    assert all(mb.inputs == () and mb.target is None for step in micro for mb in step)
    assert [mb.rows for mb in micro[0]] == list(token_plan.replicas[0].micro_batch_sizes)


def test_a_target_only_rank_keeps_the_target(token_plan, tmp_path):
    model_file = frontend.load_model_file(_recording_model(tmp_path, 50))
    reader = data.ReplicaData(model_file, token_plan, 1, CPU, needs=rows.Needs(inputs=False, target=True),
                              steps=1, num_workers=1)
    micro = reader.micro_batches(0)
    reader.close()
    start, stop = rows.rows_of_replica(token_plan, 1)
    assert all(mb.inputs == () for mb in micro)
    assert torch.cat([mb.target for mb in micro]).tolist() == \
        rows.Selection(50, GLOBAL_BATCH, seed=0).global_indices(0)[start:stop]


def test_batch_files_read_batch_only_where_needed():
    model_file = frontend.load_model_file(EXAMPLES / "mlp" / "model.py")
    g_inputs, g_target = data.global_rows(model_file, 8, 2, seed=0)
    expected_inputs, expected_target = frontend.example_batch_for_step(model_file, 8, 2)
    assert torch.equal(g_inputs[0], expected_inputs[0]) and torch.equal(g_target, expected_target)
    meta = data.meta_inputs(model_file, 5)
    assert meta[0].device.type == "meta" and meta[0].shape == (5, 32) and meta[0].dtype == torch.float32


def test_stage_needs_and_meta_inputs_on_the_planned_split(token_plan, token_file, monkeypatch):
    monkeypatch.setenv("HETPLAN_DATA", str(token_file))
    model_file = frontend.load_model_file(TOKENS / "model.py")
    meta = data.meta_inputs(model_file, 4)
    assert [(t.device.type, t.dtype, tuple(t.shape)) for t in meta] == [("meta", torch.int64, (4, 32))]
    module = frontend.build_on_meta(model_file)
    split = split_stages(frontend.trace(module, meta), [s.last_node for s in token_plan.replicas[0].stages])
    first, last = data.stage_needs(split, [0], False), data.stage_needs(split, [1], True)
    assert first == rows.Needs(inputs=True, target=False)
    assert last.target
    assert last.inputs == any(n in split.model_inputs for n in split.stages[1].inputs)


def test_batch_path_micro_batches_skip_batch_when_nothing_is_needed(token_plan):
    model_file = frontend.load_model_file(EXAMPLES / "mlp" / "model.py")
    calls = []
    original = model_file.batch
    model_file.batch = lambda b, k: calls.append((b, k)) or original(b, k)
    none = rows.micro_batches(model_file, token_plan, 0, 0, CPU, needs=rows.NOTHING)
    assert not calls and all(mb.inputs == () and mb.target is None for mb in none)
    full = rows.micro_batches(model_file, token_plan, 1, 4, CPU)
    x, y = frontend.example_batch_for_step(model_file, GLOBAL_BATCH, 4)
    start, _ = rows.rows_of_replica(token_plan, 1)
    assert torch.equal(full[0].inputs[0], x[0][start:start + full[0].rows])
    assert torch.equal(full[0].target, y[start:start + full[0].rows])


def test_batch_path_refuses_a_dataset_file(token_plan, tmp_path):
    model_file = frontend.load_model_file(_recording_model(tmp_path, 50))
    with pytest.raises(ValueError, match="ReplicaData"):
        rows.micro_batches(model_file, token_plan, 0, 0, CPU)


def test_a_step_out_of_order_restarts_the_loader(token_plan, tmp_path):
    model_file = frontend.load_model_file(_recording_model(tmp_path, 50))
    reader = data.ReplicaData(model_file, token_plan, 0, CPU, seed=2, steps=6, num_workers=1)
    try:
        later = reader.micro_batches(4)
        earlier = reader.micro_batches(1)
        with pytest.raises(ValueError, match="past"):
            reader.micro_batches(6)
    finally:
        reader.close()
    start, stop = rows.rows_of_replica(token_plan, 0)
    selection = rows.Selection(50, GLOBAL_BATCH, seed=2)
    assert torch.cat([mb.target for mb in later]).tolist() == selection.global_indices(4)[start:stop]
    assert torch.cat([mb.target for mb in earlier]).tolist() == selection.global_indices(1)[start:stop]


def _one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_dataset_shorter_than_one_global_batch_is_one_line_at_plan_time(tmp_path):
    path = _recording_model(tmp_path, 10)
    with pytest.raises(ModelFileError, match="10 samples, fewer than one global batch of 16"):
        check_dataset(frontend.load_model_file(path), 16)
    proc = run_plan_cli(str(path), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "16",
                        "--no-runners-up", "-o", str(tmp_path / "out"))
    _one_line_error(proc, "recording.py", "dataset", "10 samples", "global batch of 16", "--global-batch 10")
    assert not (tmp_path / "out").exists()


def test_dataset_rows_unlike_batch_rows_are_one_line_at_plan_time(tmp_path):
    path = _recording_model(tmp_path, 50)
    path.write_text(path.read_text().replace("torch.full((3,), float(i))", "torch.full((4,), float(i))"))
    proc = run_plan_cli(str(path), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "16",
                        "--no-runners-up", "-o", str(tmp_path / "out"))
    _one_line_error(proc, "recording.py", "dataset", "float32[2, 4]", "float32[2, 3]")


def _bad_token_file(folder: Path, ids: list[int], dtype: str, vocab: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=np.uint32).astype(dtype).tofile(folder / "tokens.bin")
    (folder / "tokens.json").write_text(json.dumps({"dtype": dtype, "vocab": vocab}))
    return folder / "tokens.bin"


@pytest.mark.parametrize(("ids", "dtype", "vocab", "needle"), [
    ([1, 2, 300] * 40, "uint16", 256, "token id 300 at position 2 is not below vocab 256"),
    ([1, 2, 3] * 40, "uint16", 70000, "dtype uint16 cannot hold the ids of vocab 70000"),
    ([1, 2, 3] * 40, "int8", 256, "dtype 'int8' is not one of uint16, uint32"),
    ([1, 2, 3] * 40, "uint32", 1000, "vocab 1000 is larger than the model's VOCAB_SIZE 256"),
])
def test_a_token_file_whose_dtype_does_not_hold_the_vocabulary_is_one_line(token_plan, tmp_path, monkeypatch, ids,
                                                                           dtype, vocab, needle):
    monkeypatch.setenv("HETPLAN_DATA", str(_bad_token_file(tmp_path / "data", ids, dtype, vocab)))
    model_file = frontend.load_model_file(TOKENS / "model.py")
    with pytest.raises(ModelFileError) as caught:      # before the first step: building the rank's loader
        data.ReplicaData(model_file, token_plan, 0, CPU)
    line = caught.value.one_line()
    assert needle in line and "model.py" in line and "\n" not in line


def test_a_bad_token_file_stops_plan_with_one_line(tmp_path, monkeypatch):
    bad = _bad_token_file(tmp_path / "data", [1, 2, 3] * 100, "uint16", 256)
    bad.write_bytes(bad.read_bytes() + b"\x01")          # half a token at the end: another dtype's file
    monkeypatch.setenv("HETPLAN_DATA", str(bad))
    proc = run_plan_cli(str(TOKENS / "model.py"), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"),
                        "--global-batch", "16", "--no-runners-up", "-o", str(tmp_path / "out"))
    _one_line_error(proc, "model.py", "dataset", "601 bytes is not a whole number of uint16 tokens")


def test_prepare_writes_a_memmap_token_file(token_file):
    meta = json.loads(token_file.with_suffix(".json").read_text())
    text = (TOKENS / "corpus.txt").read_bytes()
    assert meta == {"dtype": "uint16", "vocab": 256, "tokens": len(text), "tokenizer": "utf-8 bytes"}
    assert 4096 <= len(text) and token_file.stat().st_size == 2 * len(text)
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    assert bytes(tokens.astype(np.uint8)) == text
    assert not list(token_file.parent.glob("*.partial"))


def test_dataset_is_an_optional_renamable_contract_function(tmp_path):
    path = _recording_model(tmp_path, 20)
    assert frontend.load_model_file(EXAMPLES / "mlp" / "model.py").dataset is None
    assert frontend.load_model_file(path).dataset is not None
    path.write_text(path.read_text().replace("def dataset():", "def rows_on_disk():"))
    assert frontend.load_model_file(path).dataset is None                      # plain batch() file now
    renamed = frontend.load_model_file(path, {"dataset": "rows_on_disk"})
    assert renamed.dataset is not None and len(load_dataset(renamed)) == 20
    with pytest.raises(ModelFileError, match="no function `missing"):
        frontend.load_model_file(path, {"dataset": "missing"})
    path.write_text(path.read_text() + "\ndataset = 3\n")
    with pytest.raises(ModelFileError, match="`dataset` is a int, not a function"):
        frontend.load_model_file(path)


@pytest.mark.slow
def test_token_file_trains_on_uneven_replicas_equal_to_one_process(token_plan_dir, token_plan, token_file,
                                                                    monkeypatch):
    """`plan run --data tokens.bin`: each replica's first stage reads its share of the seeded selection,
    its last stage the targets; losses and final parameters equal one process on the same indices."""
    from backends.torchdist.reference import train_reference
    from tests.helpers import run_program

    steps = 6
    shares = [r.batch_share for r in token_plan.replicas]
    assert shares[0] != shares[1], shares                 # uneven: the fast pair takes more rows
    metrics = run_program(token_plan_dir, steps, seed=4, extra=("--data", str(token_file)))
    monkeypatch.setenv("HETPLAN_DATA", str(token_file))
    micro = [m for r in token_plan.replicas for m in r.micro_batch_sizes]
    ref = train_reference(str(TOKENS / "model.py"), global_batch=GLOBAL_BATCH, steps=steps, seed=4,
                          accumulate=micro)
    for step in range(steps):
        losses = [m["loss"] for m in metrics if m["step"] == step]
        assert len(losses) == token_plan.world_size
        assert all(loss == pytest.approx(ref.losses[step], rel=1e-5) for loss in losses), (step, losses)
    for rank in range(token_plan.world_size):
        final = torch.load(token_plan_dir / "run" / "final" / f"rank{rank}.pt")
        for name, value in final.items():
            rel = float((value - ref.params[name]).norm() / ref.params[name].norm())
            assert rel <= 1e-5, (rank, name, rel)
