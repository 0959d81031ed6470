"""Multi-latent attention (DeepSeek-V3, `deepseek_v3`) in verl's MegatronEngine with and without the switch, through
verl's TrainingWorker on CPU (one process). verl 0.9.1 builds MLA models through its bridge (an
MLATransformerConfig, megatron's MLASelfAttention; verl/models/mcore/config_converter.py); on CPU the same
megatron-core model is built on the host (integration/verl_cpu.py) with the CPU THD attention in MLA's core
attention slot. The tiny policy is the whole DeepSeek-V3 layer: MLA (q_lora_rank set, decoupled RoPE) and, after
a dense first layer, the DeepSeek MoE (sigmoid router with the fixed correction bias, group-limited top-k, a
shared expert).

Skipped cleanly without verl (`make setup-verl` installs it; `make test` does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    grpo_batch,
    infer,
    make_worker,
    max_rel_grad_error,
    one_rank,
    run_step,
    set_switch,
)

pytestmark = pytest.mark.slow


def _batch():
    return grpo_batch(seed=5, groups=2)


def _hf_log_probs(hf_dir: str, td) -> torch.Tensor:
    """Hugging Face's logprobs of each rollout's response tokens (float32), in verl's padded response layout."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    prompt = td["attention_mask"].shape[1] - td["responses"].shape[1]
    out = torch.zeros(td["responses"].shape)
    with torch.no_grad():
        for i, ids in enumerate(td["input_ids"].unbind()):
            r = int(td["attention_mask"][i, prompt:].sum())
            logp = torch.log_softmax(model(ids[None]).logits[0, -r - 1 : -1].float(), dim=-1)
            out[i, :r] = logp.gather(-1, ids[-r:, None])[:, 0]
    return out


def test_verl_mla_deepseek_v3_switch_equals_verl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compute_log_prob's logprobs and entropies (verl's own path == Hugging Face's logprobs too), every
    parameter's gradient (fp32 1e-5 relative) and verl's loss metrics: the switch == verl's own path, with
    dynamic batch size. Planted: MLA's per-layer RoPE left on megatron's table (not following the tree's position
    ids) changes the logprobs."""
    from megatron_branch.integration import verl_model

    with one_rank(tmp_path / "hf", family="deepseek_v3") as hf:
        set_switch(False)
        base = run_step(make_worker(hf, dynamic_bsz=True), _batch)
        set_switch(True)
        tree = run_step(make_worker(hf, dynamic_bsz=True), _batch)
        assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
        torch.testing.assert_close(base.log_probs, _hf_log_probs(hf, _batch()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)
        err, name = max_rel_grad_error(base.grads, tree.grads)
        assert err <= 1e-5, f"{name}: {err:.2e}"
        assert any("linear_kv_down_proj" in n for n in base.grads)  # MLA's parameters among those compared
        for key in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy_loss", "loss", "grad_norm"):
            got, want = (float(torch.as_tensor(m[key]).reshape(-1)[0]) for m in (tree.metrics, base.metrics))
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
        assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]

        monkeypatch.setattr(verl_model, "enable_position_rope", lambda model: model)  # planted
        wrong, _ = infer(make_worker(hf, dynamic_bsz=True), _batch())  # compute_log_prob only
        set_switch(False)
        assert (wrong - base.log_probs).abs().max() > 1e-3
