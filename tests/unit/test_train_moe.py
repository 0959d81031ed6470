"""`megatron-branch train` with a mixture-of-experts policy (a config-defined tiny Qwen3-MoE): router losses and
routing replay on and off; naive and replay give the same run (float64, tokens, rewards and parameters); resume
equals an uninterrupted run; the metrics carry megatron's router-loss names and the tokens per expert; what the
engine cannot do exactly is refused in one line, naming the config key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import QUIET, params

from megatron_branch.errors import UserError
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.metrics import read_metrics

MOE = (
    "model.arch={family: qwen3_moe, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "ffn_hidden_size: 32, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8, "
    "max_position_embeddings: 64}"
)
LOSSES = ("moe.aux_loss_coeff=0.01", "moe.seq_aux_loss_coeff=0.01", "moe.z_loss_coeff=0.001")
HYBRID = (  # a MoE hybrid (Qwen3.5-MoE): a gated delta net layer, then gated attention, each with a MoE block
    "model.arch={family: qwen3_5_moe, hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
    "head_dim: 8, ffn_hidden_size: 8, num_experts: 4, moe_top_k: 2, moe_ffn_hidden_size: 8, "
    "shared_expert_ffn_hidden_size: 8, shared_expert_gate: true, layer_types: [linear_attention, full_attention], "
    "linear_key_head_dim: 8, linear_value_head_dim: 8, linear_num_key_heads: 1, linear_num_value_heads: 2, "
    "rotary_percent: 0.5, max_position_embeddings: 64}"
)


def _cfg(out: Path, *overrides: str, model: str = MOE):  # noqa: ANN202
    base = [
        model,
        "data.task=needles",
        "data.task_args={length: 8, num_needles: 1}",
        "data.num_prompts=16",
        "data.train_batch_size=2",
        "rollout.n=4",
        "rollout.response_length=3",
        "rollout.branch_at=[1]",  # shared response beginnings: tokens shared within a group
        "optim.lr=0.01",
        "optim.clip_grad=0",
        "model.dtype=float64",
        f"trainer.default_local_dir={out}",
        *QUIET,
        "checkpoint.hf_export=false",
    ]
    return load_config(None, [*base, *overrides])


def _run(cfg) -> tuple[Trainer, list[dict]]:  # noqa: ANN001
    tr = Trainer(cfg)
    rows = []
    while tr.step < cfg.trainer.total_training_steps:
        m = tr.train_step()
        tr.logger.log(m)
        m["_tokens"] = [r.response for r in tr.last_batch]
        m["_records"] = [r.routed_experts for r in tr.last_batch]
        rows.append(m)
    return tr, rows


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / (a[k].abs().max() + 1e-30)) for k in a)


@pytest.mark.parametrize("replay", ["disabled", "R3"])
def test_naive_and_replay_same_run_with_router_losses(tmp_path: Path, replay: str) -> None:
    runs = {}
    for sched in ("naive", "replay"):
        cfg = _cfg(tmp_path / f"{sched}-{replay}", "trainer.total_training_steps=3", f"schedule.name={sched}",
                   f"moe.router_replay={replay}", *LOSSES)  # fmt: skip
        runs[sched] = _run(cfg)
    (a, ma), (b, mb) = runs["naive"], runs["replay"]
    for x, y in zip(ma, mb, strict=True):
        assert x["_tokens"] == y["_tokens"], x["step"]
        for k in ("loss", "load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
            assert x[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), (x["step"], k)
    assert _max_rel(params(a), params(b)) < 1e-9
    assert mb[-1]["positions_computed"] < mb[-1]["positions_logical"]
    recorded = all(r is not None for m in mb for r in m["_records"])
    assert recorded == (replay == "R3")
    line = read_metrics(tmp_path / f"replay-{replay}" / "metrics.jsonl")[-1]
    counts = line["moe/tokens_per_expert/logical/layer_0"]
    assert len(counts) == 4 and sum(counts) == 2 * line["positions_logical"]  # top-2 of every logical token
    assert sum(line["moe/tokens_per_expert/computed/layer_0"]) == 2 * line["positions_computed"]


def test_moe_hybrid_trains_and_resumes_exactly(tmp_path: Path) -> None:
    """A MoE hybrid (GDN state handed down at each fork, routing replay, router losses) trains with replay: the first
    step's losses equal naive's at the float32 delta rule's bound (later steps differ through Adam, which normalises
    each gradient element: its rounding-level differences become update-level ones), and a resumed run equals the
    uninterrupted one exactly."""
    extra = ("moe.router_replay=R3", *LOSSES)
    naive, mn = _run(_cfg(tmp_path / "naive", "trainer.total_training_steps=1", "schedule.name=naive", *extra,
                          model=HYBRID))  # fmt: skip
    full, mfull = _run(_cfg(tmp_path / "full", "trainer.total_training_steps=2", *extra, model=HYBRID))
    assert mn[0]["_tokens"] == mfull[0]["_tokens"]
    for k in ("loss", "load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
        assert mn[0][k] == pytest.approx(mfull[0][k], rel=1e-5, abs=1e-9), k
    assert mfull[-1]["positions_computed"] < mfull[-1]["positions_logical"]
    first, m1 = _run(_cfg(tmp_path / "part", "trainer.total_training_steps=1", *extra, model=HYBRID))
    first.save()
    again, m2 = _run(_cfg(tmp_path / "part", "trainer.total_training_steps=2", "trainer.resume_mode=auto", *extra,
                          model=HYBRID))  # fmt: skip
    for x, y in zip(mfull, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"] and abs(x["loss"] - y["loss"]) <= 1e-9
    assert _max_rel(params(full), params(again)) < 1e-9


def test_resume_equals_uninterrupted_with_replay(tmp_path: Path) -> None:
    extra = ("moe.router_replay=R3", *LOSSES)
    full, mfull = _run(_cfg(tmp_path / "full", "trainer.total_training_steps=3", *extra))
    first, m1 = _run(_cfg(tmp_path / "part", "trainer.total_training_steps=2", *extra))
    first.save()
    again, m2 = _run(
        _cfg(tmp_path / "part", "trainer.total_training_steps=3", "trainer.resume_mode=auto", *extra)
    )
    assert again.step == 3 and len(m2) == 1
    for x, y in zip(mfull, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"]
        assert abs(x["loss"] - y["loss"]) <= 1e-9
    assert _max_rel(params(full), params(again)) < 1e-9


@pytest.mark.parametrize(
    "overrides, words",
    [
        (("moe.expert_capacity_factor=1.0",), "moe.expert_capacity_factor: token dropping is not exact"),
        (("moe.aux_loss_coeff=-1",), "aux_loss_coeff must be a finite number >= 0"),
        (("parallel.ep=3",), "parallel.ep: expert parallel size 3 does not divide num_experts=4"),
        (("parallel.tp=2",), "at parallel.tp=2 needs parallel.sequence_parallel"),
        (("parallel.etp=2",), "parallel.etp=2 must be 1 or parallel.tp"),  # expert TP 1 trains: world 2
        (("moe.router_replay=R2",), "moe.router_replay must be one of"),
    ],
)
def test_refusals_name_the_key(tmp_path: Path, overrides: tuple, words: str) -> None:
    with pytest.raises(UserError, match=words) as e:
        _cfg(tmp_path / "x", *overrides)
    assert "\n" not in str(e.value)


def test_moe_keys_refused_for_a_dense_policy(tmp_path: Path) -> None:
    dense = ("model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
             "ffn_hidden_size: 32, max_position_embeddings: 64}")  # fmt: skip
    for extra in ("moe.router_replay=R3", "parallel.ep=2"):
        with pytest.raises(UserError, match="need a mixture-of-experts model"):
            load_config(None, [dense, "data.task=needles", extra])


def test_example_config_trains_with_a_warm_up_under_routing_replay(tmp_path: Path) -> None:
    """examples/configs/moe.yaml (R3 + router losses) with a supervised warm-up: the reference answers were never
    sampled, so the warm-up routes freshly (it used to refuse: 'no routed_experts'); RL then replays records."""
    example = Path(__file__).resolve().parents[2] / "examples" / "configs" / "moe.yaml"
    cfg = load_config(
        example,
        [
            "warmup={steps: 2, batch_size: 2}", "data.task_args={length: 8, num_needles: 1}", "data.num_prompts=8",
            "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.plot=false", "checkpoint.hf_export=false",
        ],
    )  # fmt: skip
    assert cfg.moe.router_replay == "R3" and cfg.moe.aux_loss_coeff > 0
    tr = Trainer(cfg)
    tr._warmup()
    assert tr.warmup_steps_run == 2
    m = tr.train_step()
    assert all(r.routed_experts is not None for r in tr.last_batch)
    assert m["load_balancing_loss"] > 0 and m["z_loss"] > 0
