"""Prompt datasets, rewards from `module:function`, and the built-in synthetic tasks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_branch.errors import UserError
from megatron_branch.tasks import (
    CopySpanTask,
    KeyValueTask,
    NeedleTask,
    PromptRow,
    char_match_reward,
    get_task,
    load_reward,
    read_prompts_jsonl,
    score_responses,
    warmup_rollouts,
    write_prompts_jsonl,
)
from megatron_branch.tokenizer import SentencePieceTokenizer


def test_kv_retrieval_answer_is_in_the_prompt_and_deterministic() -> None:
    task = KeyValueTask(num_pairs=12, value_len=3)
    rows = task.rows(50, seed=7)
    assert [r.prompt for r in rows] == [r.prompt for r in task.rows(50, seed=7)]
    assert [r.prompt for r in rows] != [r.prompt for r in task.rows(50, seed=8)]
    for r in rows:
        hay, query = r.prompt.split(" ? ")
        pairs = dict(p.split(":") for p in hay.split(" "))
        assert len(pairs) == 12  # distinct keys
        assert query.endswith(":") and pairs[query[:-1]] == r.fields["answer"]
        assert len(r.fields["answer"]) == 3 and set(r.fields["answer"]) <= set(task.value_chars)
    # the queried pair is anywhere in the haystack, not always at one place
    where = {
        r.prompt.split(" ? ")[0].split(" ").index(r.prompt.split(" ? ")[1][:-1] + ":" + r.fields["answer"])
        for r in rows
    }
    assert len(where) > 5


def test_copy_span_answer_is_the_marked_span() -> None:
    task = CopySpanTask(length=30, span_len=5)
    for r in task.rows(30, seed=1):
        body = r.prompt.split(" ? ")[0]
        assert body[body.index("[") + 1 : body.index("]")] == r.fields["answer"]
        assert len(body) == 30 + 5 + 2 and r.prompt.endswith("copy:")


def test_needles_each_alphabet_once_answer_in_order() -> None:
    task = NeedleTask(length=40, num_needles=3)
    positions = set()
    for r in task.rows(40, seed=2):
        body = r.prompt.split(" ? ")[0]
        assert len(body) == 43 and r.prompt.endswith("find:")
        answer = r.fields["answer"]
        for alphabet, ch in zip(task.needle_alphabets, answer):
            assert [c for c in body if c in alphabet] == [ch]  # exactly one needle of each alphabet
        assert set(body) - set(answer) <= set(task.filler_chars)
        positions.add(body.index(answer[0]))
    assert len(positions) > 10  # needles are anywhere
    with pytest.raises(UserError, match="disjoint"):
        NeedleTask(filler_chars="abcA")


def test_char_match_reward_partial_credit() -> None:
    row = {"answer": "abc"}
    assert char_match_reward("", "abc", row) == 1.0
    assert char_match_reward("", " abc ", row) == 1.0
    assert char_match_reward("", "abd", row) == pytest.approx(2 / 3)
    assert char_match_reward("", "abcd", row) == pytest.approx(3 / 4)  # extra characters cost
    assert char_match_reward("", "", row) == 0.0
    assert char_match_reward("", "xyz", row) == 0.0


def test_get_task_errors() -> None:
    assert isinstance(get_task("copy_span", span_len=3), CopySpanTask)
    with pytest.raises(UserError, match="unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(UserError, match="kv_retrieval"):
        get_task("kv_retrieval", bogus=1)
    with pytest.raises(UserError, match="distinct keys"):
        get_task("kv_retrieval", num_pairs=200, key_len=2)


def test_prompt_jsonl_round_trip_and_errors(tmp_path: Path) -> None:
    rows = get_task("kv_retrieval").rows(5, seed=0)
    path = tmp_path / "p.jsonl"
    write_prompts_jsonl(path, rows)
    back = read_prompts_jsonl(path, required=("answer",))
    assert [(r.prompt, dict(r.fields)) for r in back] == [(r.prompt, dict(r.fields)) for r in rows]
    assert back[2].where == f"{path}:3" and back[2].row["prompt"] == rows[2].prompt
    cases = {
        '{"prompt": "a", "answer": "b"}\n[1]\n': ":2: expected a JSON object",
        '{"prompt": "a", "answer": 1}\n\n{"answer": "x"}\n': ":3: missing field 'prompt'",
        '{"prompt": ""}\n': ":1: 'prompt' must be a non-empty string",
        '{"prompt": "a"\n': ":1: invalid JSON",
        '{"prompt": "a"}\n': ":1: missing field 'answer'",
        "\n\n": "no prompts",
    }
    for i, (text, msg) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text)
        with pytest.raises(UserError) as err:
            read_prompts_jsonl(bad, required=("answer",))
        assert msg in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="cannot read"):
        read_prompts_jsonl(tmp_path / "missing.jsonl")


def test_load_reward_and_scoring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompt, response, row):\n    return float(len(response)) + row['bonus']\n"
        "def broken(prompt, response, row):\n    raise KeyError('answer')\n"
        "def nan(prompt, response, row):\n    return float('nan')\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [PromptRow(prompt="p", fields={"bonus": 1.0}, where="data.jsonl:4")]
    assert score_responses(load_reward("my_rewards:length"), rows, ["abc"]) == [4.0]
    builtin = load_reward(KeyValueTask.reward_spec)
    assert score_responses(builtin, [PromptRow(prompt="q", fields={"answer": "ab"})], ["ab"]) == [1.0]
    for spec, msg in [
        ("no_colon", "must be 'module:function'"),
        ("a:b:c", "must be 'module:function'"),
        ("surely_missing_module_xyz:f", "cannot import reward module"),
        ("my_rewards:absent", "has no attribute 'absent'"),
        ("my_rewards:NOT_CALLABLE", "not callable"),
    ]:
        with pytest.raises(UserError, match=msg):
            load_reward(spec)
    with pytest.raises(UserError, match=r"data.jsonl:4: reward my_rewards:broken raised KeyError"):
        score_responses(load_reward("my_rewards:broken"), rows, ["x"])
    with pytest.raises(UserError, match="finite number"):
        score_responses(load_reward("my_rewards:nan"), rows, ["x"])
    sys.modules.pop("my_rewards", None)


def test_warmup_rollouts_are_answer_plus_eos(tmp_path: Path) -> None:
    task = get_task("kv_retrieval", num_pairs=4)
    tok = SentencePieceTokenizer.train_or_load(tmp_path, task.corpus(100, seed=0))
    rollouts = warmup_rollouts(task, tok, 6, seed=5)
    for r, (prompt, answer) in zip(rollouts, task.warmup_examples(6, seed=5)):
        assert tok.decode(r.prompt) == prompt and r.response[-1] == tok.eos_id
        assert tok.decode(r.response) == answer and r.advantage == 1.0
