"""End to end with tensor parallelism: plan --tp 2 -> emit -> run on 4 gloo processes -> equal to one process.

Each test forces the layout (`--tp 2 --stages 2`: 2 shards x 2 stages; or `--tp 2` beside 2 replicas) and
compares the run's losses and final parameters with single-process training (backends/torchdist/reference.py)
at 1e-5 relative, fp32: sharded parameters put back together from their shards (passes.tensor_parallel.unshard),
replicated ones (norms, embeddings) equal on every shard of their stage and to the reference.
Under SGD: a shard sums its matmuls' products in another order than one process, and AdamW divides each
update by sqrt(v), which turns that float noise in elements of near-zero gradient into 4e-5 relative
differences of a layer norm's bias after a few steps (measured; losses still agree at 1e-5), as
tests/test_e2e.py's ResNet check says for gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from backends.torchdist.reference import train_reference
from passes.tensor_parallel import find_regions, unshard
from planner import frontend
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, run_program
from tests.test_checkpoint_e2e import SEED, _assert_same_final_parameters, losses_by_step, train_program

STEPS = 6
LR = 0.05            # SGD's: large enough that momentum lost on resume would show in the losses


def _plan(tmp_path, model: str, cluster: str, *flags: str):
    out = tmp_path / "out"
    proc = run_plan_cli(str(EXAMPLES / model / "model.py"), "--cluster", str(CLUSTERS / cluster), "--tp", "2",
                        "--no-runners-up", *flags, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, Plan.load(out)


def _specs(model: str):
    gm, _ = frontend.trace_model(frontend.load_model_file(EXAMPLES / model / "model.py"), 4)
    return find_regions(gm).specs()


def _check(out, plan: Plan, model: str, *, optimizer: str = "adamw", accumulate: bool = True,
           extra: tuple[str, ...] = ()) -> None:
    metrics = run_program(out, STEPS, seed=3, optimizer=optimizer, extra=extra)
    ref = train_reference(str(EXAMPLES / model / "model.py"), global_batch=plan.global_batch, steps=STEPS, seed=3,
                          optimizer=optimizer,
                          accumulate=[m for r in plan.replicas for m in r.micro_batch_sizes] if accumulate else None)
    for step in range(STEPS):
        losses = [m["loss"] for m in metrics if m["step"] == step]
        assert len(losses) == plan.world_size
        assert all(loss == pytest.approx(ref.losses[step], rel=1e-5) for loss in losses), (step, losses)
    specs = _specs(model)
    finals = {r: torch.load(out / "run" / "final" / f"rank{r}.pt") for r in range(plan.world_size)}
    seen, sharded = set(), set()
    for replica in plan.replicas:
        for st in replica.stages:
            for name in st.params:
                if name not in ref.params:      # a tied weight's other name (BERT's decoder = word embeddings)
                    continue
                shards = [finals[r][name] for r in st.ranks]
                if name in specs:
                    value = unshard(shards, specs[name])
                    sharded.add(name)
                else:           # replicated: the same on every shard of the stage
                    for other in shards[1:]:
                        assert torch.equal(other, shards[0]), f"{name} differs across the shards of a stage"
                    value = shards[0]
                # a tensor that stays ~0 (BERT's key bias: its gradient is 0 but for float noise) against 1e-6
                rel = float((value - ref.params[name]).norm() / ref.params[name].norm().clamp_min(1e-6))
                assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
                seen.add(name)
    assert seen == {p for r in plan.replicas for s in r.stages for p in s.params} & set(ref.params)
    assert sharded, "no parameter was sharded"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "hf_llama", "bert"])
def test_tp2_pp2_matches_single_process(tmp_path, model):
    """GPT (fused qkv: interleaved shards), HF Llama (GQA: 2 KV heads shard beside 4 query heads; SwiGLU) and
    BERT (separate q/k/v, GELU MLP) on 2 shards x 2 stages."""
    out, plan = _plan(tmp_path, model, "cpu-4.yaml", "--stages", "2", "--global-batch", "8", "--micro-batch", "2")
    assert plan.world_size == 4 and plan.tp_degree == 2
    assert [len(r.stages) for r in plan.replicas] == [2]
    assert all(len(st.ranks) == 2 for st in plan.replicas[0].stages)
    _check(out, plan, model, optimizer="sgd")


@pytest.mark.slow
def test_gpt_tp2_dp2_zero_uneven_shares_matches_single_process(tmp_path):
    """Two replicas of TP=2 (one per node of cpu-hetero-4, the slow one 3x slower: shares 12:4), optimizer state
    sharded across the replicas (ZeRO-1, torch's ZeroRedundancyOptimizer: the SGD momentum here)."""
    out, plan = _plan(tmp_path, "gpt", "cpu-hetero-4.yaml", "--zero", "on", "--global-batch", "16",
                      "--micro-batch", "2", "--use-all-devices")
    assert plan.world_size == 4 and plan.tp_degree == 2 and len(plan.replicas) == 2
    shares = [r.batch_share for r in plan.replicas]
    assert shares[0] > shares[1], shares
    assert plan.grad_groups and all(g.zero and len(g.ranks) == 2 for g in plan.grad_groups)
    _check(out, plan, "gpt", optimizer="sgd")


@pytest.mark.slow
def test_tp_zero_plan_resumes_bit_for_bit(tmp_path):
    """A TP=2 x DP=2 ZeRO-1 plan stopped after 3 steps with a checkpoint and resumed to 6 equals 6 steps in
    one go exactly: each shard saved under its own name (checkpoint_state.shard_name), each ZeRO part by its
    owner."""
    out, _ = _plan(tmp_path, "gpt", "cpu-hetero-4.yaml", "--zero", "on", "--global-batch", "8",
                   "--micro-batch", "2", "--use-all-devices")
    program = out / "program"
    train_program(program, tmp_path / "full", 6)
    train_program(program, tmp_path / "part", 3, "--checkpoint-every", "3")
    proc = train_program(program, tmp_path / "part", 6, "--checkpoint-every", "3", "--resume")
    assert "resumed from" in proc.stdout
    full, resumed = losses_by_step(tmp_path / "full"), losses_by_step(tmp_path / "part", 3 * 4)
    assert resumed == {step: full[step] for step in range(3, 6)}
    _assert_same_final_parameters(tmp_path / "part", tmp_path / "full", 4)


@pytest.mark.slow
def test_a_tp_zero_checkpoint_resumes_without_tensor_parallelism_as_one_process(tmp_path):
    """TP=2 x DP=2 with ZeRO-1 (uneven shares) trains 3 steps and checkpoints; a plan without tensor parallelism
    (2 stages on cpu-4) resumes from it (`--resume-from`) to 6: every loss and the final parameters equal
    single-process training. The shards are put together (checkpoint_reshard.py), SGD's momentum too, which
    each ZeRO owner saved for its part: fresh momentum would miss the reference from step 4 on."""
    source, plan = _plan(tmp_path / "a", "gpt", "cpu-hetero-4.yaml", "--zero", "on", "--global-batch", "16",
                         "--micro-batch", "2", "--use-all-devices")
    assert plan.tp_degree == 2 and len(plan.replicas) == 2
    target = tmp_path / "b"
    proc = run_plan_cli(str(EXAMPLES / "gpt" / "model.py"), "--cluster", str(CLUSTERS / "cpu-4.yaml"), "--tp", "1",
                        "--stages", "2", "--global-batch", "16", "--micro-batch", "2", "--no-runners-up",
                        "-o", str(target))
    assert proc.returncode == 0, proc.stderr
    resumed = Plan.load(target)
    assert resumed.tp_degree == 1
    flags = ("--optimizer", "sgd", "--lr", str(LR))
    train_program(source / "program", tmp_path / "first", 3, *flags, "--checkpoint-every", "3")
    proc = train_program(target / "program", tmp_path / "then", 6, *flags, "--resume-from",
                         str(tmp_path / "first" / "ckpt"))
    assert "resumed from" in proc.stdout
    ref = train_reference(str(EXAMPLES / "gpt" / "model.py"), global_batch=16, steps=6, seed=SEED, lr=LR,
                          optimizer="sgd")
    losses = {**losses_by_step(tmp_path / "first"), **losses_by_step(tmp_path / "then")}
    assert sorted(losses) == list(range(6))
    for step, loss in losses.items():
        assert loss == pytest.approx(ref.losses[step], rel=1e-5), (step, loss, ref.losses[step])
    for replica in resumed.replicas:
        for st in replica.stages:
            final = torch.load(tmp_path / "then" / "final" / f"rank{st.ranks[0]}.pt")
            for name in (n for n in st.params if n in ref.params):
                rel = float((final[name] - ref.params[name]).norm() / ref.params[name].norm().clamp_min(1e-6))
                assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
    _check_whole_weights_of(tmp_path, source, tmp_path / "first" / "ckpt", target, flags)


def _check_whole_weights_of(tmp_path, source, ckpt, target, flags) -> None:
    """The TP=2 checkpoint after 3 steps as whole weights: `plan export --safetensors` writes one process's
    parameters after 3 steps, and a run of another plan started from it (`--weights CKPT`, a fresh
    optimizer) has the first loss of one process started from the exported files."""
    weights_dir = tmp_path / "weights"
    proc = run_plan_cli("export", str(source), "--safetensors", str(weights_dir), "--checkpoint", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    exported = load_file(weights_dir / "model.safetensors")
    ref = train_reference(str(EXAMPLES / "gpt" / "model.py"), global_batch=16, steps=3, seed=SEED, lr=LR,
                          optimizer="sgd")
    assert sorted(exported) == sorted(ref.params)
    for name, tensor in exported.items():
        rel = float((tensor - ref.params[name]).norm() / ref.params[name].norm().clamp_min(1e-6))
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
    train_program(target / "program", tmp_path / "fresh", 1, *flags, "--weights", str(ckpt))
    fresh = train_reference(str(EXAMPLES / "gpt" / "model.py"), global_batch=16, steps=1, seed=SEED, lr=LR,
                            optimizer="sgd", weights_path=weights_dir)
    assert losses_by_step(tmp_path / "fresh")[0] == pytest.approx(fresh.losses[0], rel=1e-5)


def check_llama_tp2_on_cpu4(plan_with, tmp_path, stages: int) -> None:
    """The HF Llama example planned by `plan_with(tmp_path, model, *flags, cluster=...)` (a test's own, with
    its schedule) as one replica at TP 2 on cpu-4 trains as one process (GQA: KV heads shard too): each
    shard's parameters put back together (SGD: no AdamW amplification of float noise)."""
    pytest.importorskip("transformers")
    out, plan = plan_with(tmp_path, "hf_llama", "--global-batch", "8", "--stages", str(stages), "--tp", "2",
                          "--micro-batch", "2", cluster="cpu-4.yaml")
    assert plan.tp_degree == 2 and len(plan.replicas) == 1
    _check(out, plan, "hf_llama", optimizer="sgd")
