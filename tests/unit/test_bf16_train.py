"""`train` and `grad` in bf16 (model.dtype: bfloat16, grad --dtype bfloat16): megatron's mixed precision end to end.

- A bf16 run checkpointed and resumed equals the run that never stopped, bitwise (bf16 parameters, fp32 main
  parameters, Adam's moments, losses): the fp32 main parameters and the optimizer state are in the dist checkpoint
  (megatron's `fp32_from_fp16_params` / the distributed optimizer's `param`), with the plain optimizer and with the
  planner's choice for the 32B target (distributed optimizer, half of its state offloaded).
- The final export and `convert mcore-to-hf` of an intermediate checkpoint are bf16 HF folders holding the run's
  bf16 weights exactly.
- `grad --dtype bfloat16` writes the fp32 main gradients, within the bf16 bound of float64 (tests/unit/test_bf16.py);
  model.dtype=float16 is refused in one line (no loss scale in the schedules' backward);
  `--grad-sync manual` (gradients summed in bf16) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_branch.cli import main
from megatron_branch.train.config import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.models import unwrap

BASE = [
    "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2, "
    "ffn_hidden_size: 32, max_position_embeddings: 64}",
    "model.dtype=bfloat16",
    "data.task=kv_retrieval",
    "data.task_args={num_pairs: 2, value_len: 2, value_chars: abcd}",
    "data.num_prompts=16",
    "data.train_batch_size=2",
    "rollout.n=3",
    "rollout.response_length=3",
    "optim.lr=0.01",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]
OPTIMIZERS = {
    "plain": [],
    "offload": [
        "optim.use_distributed_optimizer=true",
        "optim.use_precision_aware_optimizer=true",
        "optim.optimizer_cpu_offload=true",
        "optim.optimizer_offload_fraction=0.5",
    ],
}


def _cfg(out: Path, *extra: str):  # noqa: ANN202
    return load_config(None, [*BASE, f"trainer.default_local_dir={out}", *extra])


def _state(tr: Trainer) -> dict[str, torch.Tensor]:
    """bf16 parameters and the optimizer's fp32 main parameters and moments, by name."""
    from megatron_branch.update.optimizer import inner_optimizers

    out = {f"param.{k}": v.detach().clone() for k, v in unwrap(tr.policy).named_parameters()}
    (inner,) = inner_optimizers(tr.actor.policy.optimizer)
    opt = inner.optimizer
    for i, (_, st) in enumerate(sorted(opt.state.items(), key=lambda kv: _index(opt, kv[0]))):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out[f"state.{i}.{k}"] = v.detach().clone()
    mains = [getattr(p, "main_param", None) for p in unwrap(tr.policy).parameters()]
    out.update({f"main.{i}": m.detach().clone() for i, m in enumerate(mains) if m is not None})
    return out


def _index(opt, p) -> int:  # noqa: ANN001
    flat = [q for g in opt.param_groups for q in g["params"]]
    return next(i for i, q in enumerate(flat) if q is p)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_bf16_run_resumes_exactly(tmp_path: Path, optimizer: str) -> None:
    from megatron.core.dist_checkpointing import load_plain_tensors

    extra = OPTIMIZERS[optimizer]
    whole = Trainer(
        _cfg(tmp_path / "whole", *extra, "trainer.total_training_steps=4", "checkpoint.hf_export=false")
    )
    losses = [whole.train_step()["loss"] for _ in range(4)]
    want = _state(whole)
    assert any(k.startswith("main.") or k.startswith("state.") for k in want)
    assert {v.dtype for k, v in want.items() if k.startswith("param.")} == {torch.bfloat16}
    assert {v.dtype for k, v in want.items() if not k.startswith("param.")} == {torch.float32}

    part = tmp_path / "part"
    first = Trainer(_cfg(part, *extra, "trainer.total_training_steps=2", "checkpoint.hf_export=false"))
    first.run()
    # the checkpoint holds, beside each bf16 weight, its fp32 main parameter (megatron's `fp32_param`, or the
    # distributed optimizer's `param`) and Adam's fp32 moments; the weight is the main parameter rounded
    flat = _flatten(load_plain_tensors(str(part / "checkpoints" / "step_00000002")))
    weights = {k: v for k, v in flat.items() if not k.startswith(("optimizer.", "policy."))}
    assert weights and {v.dtype for v in weights.values()} == {torch.bfloat16}
    kept_bits = False
    for k, w in weights.items():
        (main,) = [
            flat[f"optimizer.state.{m}.{k}"]
            for m in ("fp32_param", "param")
            if f"optimizer.state.{m}.{k}" in flat
        ]
        assert main.dtype == torch.float32 and torch.equal(main.to(torch.bfloat16), w), k
        kept_bits |= not torch.equal(main, w.float())
        for moment in ("exp_avg", "exp_avg_sq"):
            assert flat[f"optimizer.state.{moment}.{k}"].dtype == torch.float32, (k, moment)
    assert kept_bits  # the main parameters are not the bf16 weights widened: their fp32 bits were saved
    resumed = Trainer(_cfg(part, *extra, "trainer.total_training_steps=4", "trainer.resume_mode=auto",
                           "checkpoint.hf_export=false"))  # fmt: skip
    assert resumed.step == 2
    got_losses = [resumed.train_step()["loss"] for _ in range(2)]
    assert got_losses == losses[2:]
    got = _state(resumed)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _flatten(d: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(d, torch.Tensor):
        out[prefix[:-1]] = d
    return out


@pytest.mark.slow
def test_bf16_run_exports_bf16_hf_folders(tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "run"
    tr = Trainer(_cfg(out, "trainer.total_training_steps=2", "checkpoint.hf_export=true"))
    tr.train_step()
    tr.save()
    step1 = unwrap(tr.policy).embedding.word_embeddings.weight.detach().clone()
    summary = tr.run()
    assert summary["hf"] and json.loads((out / "exports.json").read_text()) == {"step": 2}
    final = unwrap(tr.policy).embedding.word_embeddings.weight.detach()
    for folder, want in ((out / "hf", final), (tmp_path / "hf1", step1)):
        if folder.name == "hf1":
            assert main(["convert", "mcore-to-hf", "--mcore", str(out / "checkpoints" / "step_00000001"),
                         "--out", str(folder)]) == 0  # fmt: skip
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16", cfg
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}
            emb = f.get_tensor("model.embed_tokens.weight")
        assert dtypes == {torch.bfloat16}
        assert torch.equal(emb, want[: emb.shape[0]]), folder  # the run's bf16 weights, exactly


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    d = tmp_path_factory.mktemp("grad_bf16")
    model = tiny_hf_model(tiny_hf_config("qwen2"), seed=0)
    with torch.no_grad():  # bf16-valued weights (stored fp32): every --dtype holds exactly the same model
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(d / "hf")
    write_rollouts_jsonl(d / "r.jsonl", random_tree_rollouts(groups=2, prompt_len=10, branches=4, levels=2,
                                                             seg_len=(2, 5), seed=3))  # fmt: skip
    return d


def _grad(assets: Path, tmp: Path, *flags: str, capsys) -> tuple[dict[str, torch.Tensor], dict]:  # noqa: ANN001
    from safetensors.torch import load_file

    out = tmp / f"g{len(list(tmp.iterdir()))}.safetensors"
    rc = main(
        ["grad", "--hf", str(assets / "hf"), "--rollouts", str(assets / "r.jsonl"), "--out", str(out), *flags]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    return load_file(str(out)), summary


@pytest.mark.slow
def test_grad_bf16_writes_fp32_main_gradients_within_the_bound(assets: Path, tmp_path: Path, capsys) -> None:
    from megatron_branch.parallel.groups import destroy_parallel

    ref, _ = _grad(assets, tmp_path, "--schedule", "naive", "--dtype", "float64", capsys=capsys)
    destroy_parallel()
    runs = {}
    for s in ("naive", "replay"):
        runs[s], summary = _grad(assets, tmp_path, "--schedule", s, "--dtype", "bfloat16", capsys=capsys)
        destroy_parallel()
        assert summary["dtype"] == "bfloat16" and summary["grad_dtype"] == "float32"
        assert {g.dtype for g in runs[s].values()} == {torch.float32}
    # the bound of tests/unit/test_bf16.py (RATIO = 2), through the command: per tensor, replay's bf16 error against
    # the float64 run of the same (bf16-valued) weights is at most twice naive's
    for n, want in ref.items():
        e = {s: float((runs[s][n].double() - want).norm() / want.norm()) for s in runs}
        assert 0 < e["naive"] < 0.1 and e["replay"] <= 2.0 * e["naive"], (n, e)


def test_grad_bf16_with_gradients_summed_in_bf16_is_refused(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "never.safetensors"
    rc = main(["grad", "--hf", str(assets / "hf"), "--rollouts", str(assets / "r.jsonl"), "--out", str(out),
               "--dtype", "bfloat16", "--grad-sync", "manual"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and not out.exists()
    assert "--dtype bfloat16 accumulates gradients in megatron DDP's fp32 main gradients" in err, err


def test_train_refuses_fp16_in_one_line(tmp_path: Path) -> None:
    """fp16 would need megatron's loss scale in every backward of the schedules: refused, not silently unscaled."""
    from megatron_branch.errors import UserError

    with pytest.raises(UserError) as e:
        _cfg(tmp_path / "run", "model.dtype=float16")
    assert "model.dtype=float16: training in fp16 needs megatron's dynamic loss scale" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()
