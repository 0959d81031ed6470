"""`train` with multi-turn rollouts (examples/configs/agent.yaml, shrunk): the tool task's rollouts carry tool calls
and loss_mask 0 on the tool's answers, naive and replay train the same run (same tokens, same rewards, parameters
at 1e-9 in float64), resume is exact, and bad rollout.multi_turn settings are one line with exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_bad_inputs import refused
from test_train_loop import _max_rel, _params, _run

from megatron_branch.errors import UserError
from megatron_branch.tasks import LookupEnv, LookupTask
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer

AGENT = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "agent.yaml")
SHRUNK = [
    "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2, "
    "ffn_hidden_size: 32, max_position_embeddings: 64}",
    "model.dtype=float64",
    "data.num_prompts=16",
    "data.train_batch_size=2",
    "rollout.n=4",
    "rollout.response_length=12",
    "warmup.steps=30",
    "warmup.batch_size=16",
    "warmup.lr=0.01",
    "optim.lr=0.01",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.hf_export=false",
]


def agent_cfg(out: Path, *overrides: str):  # noqa: ANN201
    return load_config(AGENT, [*SHRUNK, f"trainer.default_local_dir={out}", *overrides])


@pytest.mark.slow
def test_agent_config_naive_equals_replay_and_resumes_exactly(tmp_path: Path) -> None:
    runs = {s: _run(agent_cfg(tmp_path / s, f"schedule.name={s}", "trainer.total_training_steps=5"))
            for s in ("replay", "naive")}  # fmt: skip
    (ref, mref), (naive, mnaive) = runs["replay"], runs["naive"]
    calls = sum(m["multi_turn/tool_calls_mean"] for m in mref)
    assert calls > 0, "the run must see tool calls"
    for x, y in zip(mref, mnaive, strict=True):
        assert x["_tokens"] == y["_tokens"] and x["_rewards"] == y["_rewards"], x["step"]
        assert x["multi_turn/trained_fraction"] == y["multi_turn/trained_fraction"]
    assert any(m["multi_turn/trained_fraction"] < 1 for m in mref)  # tool answers are context, not trained
    assert mref[-1]["positions_computed"] < mref[-1]["positions_logical"]
    assert _max_rel(_params(ref), _params(naive)) < 1e-9
    assert tool_answers_masked(ref.dataset.tokenizer, ref.last_batch) > 0
    first, m1 = _run(agent_cfg(tmp_path / "part", "trainer.total_training_steps=3"))
    first.save()
    again, m2 = _run(
        agent_cfg(tmp_path / "part", "trainer.total_training_steps=5", "trainer.resume_mode=auto")
    )
    assert again.step == 5 and len(m2) == 2
    for x, y in zip(mref, m1 + m2, strict=True):
        assert x["_tokens"] == y["_tokens"] and abs(x["loss"] - y["loss"]) <= 1e-9, x["step"]
    assert _max_rel(_params(ref), _params(again)) < 1e-9


def tool_answers_masked(tok, batch) -> int:  # noqa: ANN001
    """Every maximal run of loss_mask 0 tokens is a tool answer ("=value;", "=?;", cut by the budget) right after
    a turn end "]"; -> how many there are."""
    seen = 0
    for r in batch:
        mask = r.loss_mask or (True,) * len(r.response)
        text = [tok.decode([t]) if t != tok.eos_id else "<eos>" for t in r.response]
        j = 0
        while j < len(text):
            if mask[j]:
                j += 1
                continue
            k = j
            while k < len(text) and not mask[k]:
                k += 1
            assert text[j - 1] == "]" and re.fullmatch(r"=[a-h?]*;?", "".join(text[j:k])), (text, mask)
            seen, j = seen + 1, k
    return seen


def test_agent_config_runs_a_step_with_its_metrics(tmp_path: Path) -> None:
    """One step of the shrunk config, no warm-up: the multi-turn metrics are reported and agree with the batch."""
    tr = Trainer(agent_cfg(tmp_path / "one", "trainer.total_training_steps=1", "warmup.steps=0"))
    m = tr.train_step()
    batch = tr.last_batch
    assert len(batch) == 8 and m["multi_turn/turns_mean"] >= 1
    trained = sum(r.num_trained for r in batch) / sum(len(r.response) for r in batch)
    assert m["multi_turn/trained_fraction"] == trained
    assert m["multi_turn/tool_calls_mean"] == tool_answers_masked(tr.dataset.tokenizer, batch) / len(batch)


def test_lookup_env_answers_only_through_the_tool() -> None:
    row = LookupTask().rows(1, seed=3)[0].row

    class Chars:
        def encode(self, s: str) -> list[int]:
            return [ord(c) for c in s]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

    tok = Chars()
    env = LookupEnv(row, tok)
    env.reset(())
    got = env.step(tuple(tok.encode(f"[{row['key']}]")))
    assert tok.decode(list(got.observation)) == f"={row['answer']};" and not got.done
    final = env.step(tuple(tok.encode(row["answer"])))
    assert final.done and final.reward == 1.0
    blind = LookupEnv(row, tok, tool=False).step(tuple(tok.encode(f"[{row['key']}]")))
    assert tok.decode(list(blind.observation)) == "=?;"


@pytest.mark.parametrize(
    "override,needle",
    [
        (
            "rollout.multi_turn.branch_at_turns=[1]",
            "rollout.multi_turn.branch_at_turns needs rollout.multi_turn.enable=true",
        ),
        ("rollout.multi_turn.max_user_turns=0", "rollout.multi_turn.max_user_turns must be a positive int"),
        ("rollout.multi_turn.branch_at_turns=[2, 1]", "rollout.multi_turn.branch_at_turns must be strictly"),
        ("rollout.multi_turn.branch_at_turns=[3]", "below rollout.multi_turn.max_assistant_turns=3"),
        ("rollout.n=5", "rollout.n=5 must be divisible by rollout.branch_factor"),
        ("rollout.branch_at=[2]", "rollout.branch_at and rollout.multi_turn.branch_at_turns both fork"),
        ("data.reward=m:f", "the environment's rewards are the reward"),
        ("warmup.until_exact=0.5", "its greedy check has no environment"),
    ],
)
def test_bad_multi_turn_settings_are_refused(tmp_path: Path, override: str, needle: str) -> None:
    with pytest.raises(UserError, match=re.escape(needle)):
        if "needs rollout.multi_turn.enable" in needle:  # a single-turn run given a multi-turn setting
            load_config(None, ["data.task=needles", override, f"trainer.default_local_dir={tmp_path}"])
        else:
            agent_cfg(tmp_path / "x", override)


def test_bad_multi_turn_setting_exits_2_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    refused(["train", AGENT, f"trainer.default_local_dir={out}", "rollout.multi_turn.max_assistant_turns=0"],
            tmp_path / "run", capsys, "rollout.multi_turn.max_assistant_turns must be a positive int")  # fmt: skip
    refused(["train", AGENT, f"trainer.default_local_dir={out}", "rollout.multi_turn.turn_end=[ab]"],
            tmp_path / "run", capsys, "rollout.multi_turn.turn_end: 'ab' is 2 tokens")  # fmt: skip
    refused(["train", AGENT, f"trainer.default_local_dir={out}", "rollout.multi_turn.environment=no_such_mod:Env"],
            tmp_path / "run", capsys, "cannot import environment module 'no_such_mod'")  # fmt: skip
    refused(["train", AGENT, f"trainer.default_local_dir={out}", "rollout.multi_turn.environment_args={depth: 2}"],
            tmp_path / "run", capsys, "could not be built: TypeError")  # fmt: skip
