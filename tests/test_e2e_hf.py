"""End to end with a Hugging Face model: rotary tables and the causal mask cross the stage cut as
context values (no gradient), the hidden state as an activation."""

from __future__ import annotations

import textwrap

import pytest

from backends.torchdist.reference import train_reference
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, run_program

STEPS = 3


@pytest.mark.slow
def test_hf_llama_two_stages_two_replicas_matches_single_process(tmp_path):
    model = EXAMPLES / "hf_llama" / "model.py"
    out = tmp_path / "out"
    proc = run_plan_cli(str(model), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "--stages", "2", "--use-all-devices", "--micro-batch", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert [len(r.stages) for r in plan.replicas] == [2, 2]
    metrics = run_program(out, STEPS, seed=1, save_final=False)
    ref = train_reference(str(model), global_batch=8, steps=STEPS, seed=1)
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[m["step"]], rel=1e-5)
    assert len(metrics) == STEPS * plan.world_size


@pytest.mark.slow
def test_hf_llama_from_pretrained_safetensors_matches_single_process(tmp_path):
    """`plan run --weights` of a save_pretrained folder: every rank reads its stage's tensors from the
    checkpoint (the model file wraps the HF model: names differ by the wrapper's prefix), and training
    equals one process started from the same weights, not from the seed's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import read_metrics

    model = EXAMPLES / "hf_llama" / "model.py"
    spec = __import__("importlib").util.spec_from_file_location("hf_llama_example", model)
    example = __import__("importlib").util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(1234)                    # other values than any seed's contract gives
    pretrained = LlamaForCausalLM(LlamaConfig(**example.CONFIG))
    with torch.no_grad():
        for p in pretrained.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not an initial state: norms away from ones
    folder = tmp_path / "llama-hf"
    pretrained.save_pretrained(folder, safe_serialization=True)
    assert (folder / "model.safetensors").is_file()

    out = tmp_path / "out"
    proc = run_plan_cli(str(model), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "--stages", "2", "--use-all-devices", "--micro-batch", "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    metrics = run_program(out, STEPS, seed=1, extra=("--weights", str(folder)))
    ref = train_reference(str(model), global_batch=8, steps=STEPS, seed=1, weights_path=folder)
    seeded = train_reference(str(model), global_batch=8, steps=1, seed=1)
    assert ref.losses[0] != pytest.approx(seeded.losses[0], rel=1e-3)   # the weights count
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[m["step"]], rel=1e-5)
    assert len(metrics) == STEPS * plan.world_size
    for rank in range(plan.world_size):
        final = torch.load(out / "run" / "final" / f"rank{rank}.pt")
        for name, value in final.items():
            rel = float((value - ref.params[name]).norm() / ref.params[name].norm())
            assert rel <= 1e-5, (rank, name, rel)
    assert read_metrics(out / "run" / "metrics.jsonl")


@pytest.mark.slow
def test_weights_missing_or_misshaped_tensor_is_one_line_before_any_rank(tmp_path):
    import importlib.util

    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    model = EXAMPLES / "hf_llama" / "model.py"
    spec = importlib.util.spec_from_file_location("hf_llama_example2", model)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    folder = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**example.CONFIG)).save_pretrained(folder, safe_serialization=True)
    tensors = load_file(folder / "model.safetensors")
    out = tmp_path / "out"
    proc = run_plan_cli(str(model), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    missing = dict(tensors)
    del missing["model.layers.1.mlp.down_proj.weight"]
    misshaped = dict(tensors)
    misshaped["model.norm.weight"] = misshaped["model.norm.weight"][:-1].clone()
    for case, content, needle in (("missing", missing, "model.layers.1.mlp.down_proj.weight"),
                                  ("misshaped", misshaped, "model.norm.weight")):
        path = tmp_path / f"{case}.safetensors"
        save_file(content, str(path))
        run = __import__("subprocess").run(
            [__import__("sys").executable, "-m", "planner.cli", "run", str(out), "--steps", "1",
             "--weights", str(path)], capture_output=True, text=True, timeout=300)
        assert run.returncode != 0
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and str(path) in lines[0], run.stderr
        assert not (out / "run" / "metrics.jsonl").exists()          # no rank started


@pytest.mark.slow
def test_hf_gpt2_with_tied_embeddings_and_model_output_matches_single_process(tmp_path):
    """A stock GPT2LMHeadModel as a user writes it: the LM head tied to the token embedding (the graph
    reads it as `lm_head.weight`, named_parameters() only as `transformer.wte.weight`) and a ModelOutput
    handed to the loss; 2 stages x 2 replicas train equal to one process."""
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent('''
        import torch
        import torch.nn.functional as F
        from transformers import GPT2Config, GPT2LMHeadModel

        CONFIG = dict(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                      eos_token_id=0)

        def model():
            return GPT2LMHeadModel(GPT2Config(**CONFIG))

        def batch(n, step):
            tokens = torch.randint(128, (n, 17), generator=torch.Generator().manual_seed(step))
            return (tokens[:, :-1],), tokens[:, 1:]

        def loss_fn(output, target):
            return F.cross_entropy(output.logits.reshape(-1, 128), target.reshape(-1))
    '''))
    out = tmp_path / "out"
    proc = run_plan_cli(str(model), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"), "--global-batch", "8",
                        "--stages", "2", "--use-all-devices", "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert any(len(g.ranks) > 2 for g in plan.grad_groups)       # the tied weight spans both stages
    metrics = run_program(out, STEPS, seed=2, save_final=False)
    ref = train_reference(str(model), global_batch=8, steps=STEPS, seed=2,
                          accumulate=[m for r in plan.replicas for m in r.micro_batch_sizes])
    assert len(metrics) == STEPS * plan.world_size
    for m in metrics:
        assert m["loss"] == pytest.approx(ref.losses[m["step"]], rel=1e-5)
