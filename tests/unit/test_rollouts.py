"""Rollout JSONL reading and writing: good files load, bad ones fail on one line naming file:line and the fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_branch.data import PrefixTree, Rollout, read_rollouts_jsonl, write_rollouts_jsonl
from megatron_branch.errors import UserError


def _write(tmp_path: Path, lines: list[str], name: str = "rollouts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _line(**obj: object) -> str:
    return json.dumps(obj)


GOOD = _line(prompt=[1, 2], response=[3, 4], advantage=0.5)


def test_reads_good_file_with_token_fields_and_metadata(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            GOOD,
            "",  # blank lines are skipped
            "   ",
            _line(
                prompt=[], response=[5], advantage=-1, old_logprobs=[-0.25], uid="abc", tags=[], reward=1.0
            ),
            _line(prompt=[1, 2], response=[6], advantage=0.0, messages=["a", "b"]),
        ],
    )
    rollouts = read_rollouts_jsonl(path, vocab_size=10)
    assert rollouts == [
        Rollout(prompt=(1, 2), response=(3, 4), advantage=0.5),
        Rollout(prompt=(), response=(5,), advantage=-1.0, token_fields={"old_logprobs": (-0.25,)}),
        Rollout(prompt=(1, 2), response=(6,), advantage=0.0),
    ]
    assert isinstance(rollouts[1].advantage, float)
    assert PrefixTree.build(rollouts).unpack() == [(1, 2, 3, 4), (5,), (1, 2, 6)]


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    rollouts = [
        Rollout(
            prompt=[1, 2, 3], response=[4, 5], advantage=1.25, token_fields={"old_logprobs": [-0.5, -1.5]}
        ),
        Rollout(prompt=[], response=[9], advantage=-0.75),
    ]
    path = tmp_path / "out.jsonl"
    write_rollouts_jsonl(path, rollouts)
    assert read_rollouts_jsonl(path) == rollouts


BAD_CASES = [
    pytest.param("{not json", "invalid JSON", id="invalid-json"),
    pytest.param("[1, 2]", "JSON object", id="not-object"),
    pytest.param(_line(response=[3], advantage=0.0), "missing field 'prompt'", id="missing-prompt"),
    pytest.param(_line(prompt=[1], advantage=0.0), "missing field 'response'", id="missing-response"),
    pytest.param(_line(prompt=[1], response=[2], pair=[1]), "pair must be a JSON scalar", id="pair-list"),
    pytest.param(_line(prompt=[1], response=[2], chosen=1), "chosen must be true or false", id="chosen-int"),
    pytest.param(
        _line(prompt=[1], response=[2], old_logprobs="x"), "must be a list of numbers", id="old-str"
    ),
    pytest.param(_line(prompt="1 2", response=[3], advantage=0.0), "prompt must be a list", id="prompt-str"),
    pytest.param(_line(prompt=[1], response=7, advantage=0.0), "response must be a list", id="response-int"),
    pytest.param(_line(prompt=[1], response=[], advantage=0.0), "response is empty", id="empty-response"),
    pytest.param(
        _line(prompt=[1, -3], response=[2], advantage=0.0), "prompt token 1 is negative", id="negative"
    ),
    pytest.param(
        _line(prompt=[1], response=[2, 2.5], advantage=0.0), "response token 1 is 2.5", id="float-id"
    ),
    pytest.param(_line(prompt=[True], response=[2], advantage=0.0), "prompt token 0 is True", id="bool-id"),
    pytest.param(_line(prompt=[1], response=["a"], advantage=0.0), "response token 0 is 'a'", id="str-id"),
    pytest.param(
        _line(prompt=[1], response=[2, 3, 100], advantage=0.0),
        "response token 2 is id 100, out of range for vocab_size 50",
        id="vocab",
    ),
    pytest.param(
        _line(prompt=[1], response=[2], advantage="high"), "advantage must be a finite number", id="adv-str"
    ),
    pytest.param(
        _line(prompt=[1], response=[2], advantage=True), "advantage must be a finite number", id="adv-bool"
    ),
    pytest.param('{"prompt": [1], "response": [2], "advantage": NaN}', "finite", id="adv-nan"),
    pytest.param('{"prompt": [1], "response": [2], "advantage": Infinity}', "finite", id="adv-inf"),
    pytest.param(
        _line(prompt=[1], response=[2, 3], advantage=0.0, old_logprobs=[-1.0]),
        "field 'old_logprobs' has 1 values but the response has 2 tokens",
        id="field-length",
    ),
]


@pytest.mark.parametrize(("bad_line", "what"), BAD_CASES)
def test_bad_line_names_file_line_and_fault(tmp_path: Path, bad_line: str, what: str) -> None:
    path = _write(tmp_path, [GOOD, "", bad_line, GOOD], name="batch_7.jsonl")
    with pytest.raises(UserError) as info:
        read_rollouts_jsonl(path, vocab_size=50)
    message = str(info.value)
    assert "\n" not in message, message
    assert "batch_7.jsonl:3" in message, message  # the blank line 2 still counts
    assert what in message, message
    assert info.value.where == f"{path}:3"


def test_empty_file_has_no_rollouts(tmp_path: Path) -> None:
    path = _write(tmp_path, ["", "  "], name="empty.jsonl")
    with pytest.raises(UserError, match=r"empty\.jsonl: no rollouts") as info:
        read_rollouts_jsonl(path)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(UserError, match=r"nowhere\.jsonl: cannot read") as info:
        read_rollouts_jsonl(path)
    assert "\n" not in str(info.value)


def test_non_utf8_file_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(UserError, match=r"binary\.jsonl: cannot read") as info:
        read_rollouts_jsonl(path)
    assert "\n" not in str(info.value)


def test_objective_fields_round_trip_and_remember_their_line(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "dpo.jsonl"
    path.write_text(
        _line(prompt=[1], response=[2, 3], pair="q1", chosen=True, ref_logprobs=[-1.0, -2.0])
        + "\n"
        + _line(prompt=[1], response=[4], pair="q1", chosen=False, ref_logprobs=[-0.5], advantages=[0.25])
        + "\n"
    )
    a, b = read_rollouts_jsonl(path)
    assert a.advantage is None and a.pair == "q1" and a.chosen is True and a.where == f"{path}:1"
    assert b.field("advantages") == (0.25,) and b.field("old_logprobs") is None and b.where == f"{path}:2"
    write_rollouts_jsonl(tmp_path / "again.jsonl", [a, b])
    assert read_rollouts_jsonl(tmp_path / "again.jsonl") == [a, b]


# ---- loss_mask (issue 31): one 0/1 per response token; absent = all ones ---------------------------------------

BAD_MASKS = {
    "wrong-length": ([1, 0], "has 2 values but the response has 3 tokens"),
    "empty-list": ([], "has 0 values but the response has 3 tokens"),
    "two": ([1, 2, 0], "value 1 is 2: must be 0, 1, false or true"),
    "half": ([1, 0.5, 0], "value 1 is 0.5"),
    "float-one": ([1.0, 1, 0], "value 0 is 1.0"),
    "minus-one": ([1, -1, 0], "value 1 is -1"),
    "string-one": ([1, "1", 0], 'value 1 is "1"'),
    "null-value": ([1, None, 0], "value 1 is null"),
    "nested": ([1, [1], 0], "value 1 is [1]"),
    "scalar": (1, "must be a list of 0/1 (one per response token), got int"),
    "string": ("110", "got str"),
    "object": ({"0": 1}, "got dict"),
    "null": (None, "got null"),
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_malformed_loss_mask_names_file_line_and_field(tmp_path: Path, case: str) -> None:
    mask, what = BAD_MASKS[case]
    bad = json.dumps({"prompt": [1], "response": [2, 3, 4], "advantage": 0.0, "loss_mask": mask})
    path = _write(tmp_path, [GOOD, bad], name="mt.jsonl")
    with pytest.raises(UserError) as info:
        read_rollouts_jsonl(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}:2" in message and "loss_mask" in message, message
    assert what in message, message
    with pytest.raises(UserError, match="loss_mask"):  # the record refuses it too (Python callers)
        Rollout(prompt=(1,), response=(2, 3, 4), loss_mask=mask if mask is not None else "x", where="r")


def test_loss_mask_reads_0_1_and_bools_round_trips_and_all_ones_is_absent(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _line(prompt=[1], response=[2, 3, 4], advantage=1.0, loss_mask=[1, 0, 1]),
            _line(prompt=[1], response=[2, 3, 5], advantage=1.0, loss_mask=[True, False, False]),
            _line(prompt=[1], response=[2, 6], advantage=1.0, loss_mask=[1, 1]),
            _line(prompt=[1], response=[7], advantage=1.0, loss_mask=[0]),
        ],
    )
    rs = read_rollouts_jsonl(path)
    assert [r.loss_mask for r in rs] == [(True, False, True), (True, False, False), None, (False,)]
    assert [r.num_trained for r in rs] == [2, 1, 2, 0]
    assert rs[0].trained_positions() == (0, 2) and rs[2].trained_positions() is None
    assert rs[2] == Rollout(prompt=(1,), response=(2, 6), advantage=1.0)  # all ones == no mask, bit for bit
    out = tmp_path / "back.jsonl"
    write_rollouts_jsonl(out, rs)
    assert read_rollouts_jsonl(out) == rs
    assert json.loads(out.read_text().splitlines()[0])["loss_mask"] == [1, 0, 1]
    assert "loss_mask" not in json.loads(out.read_text().splitlines()[2])
    assert "loss_mask" not in rs[0].token_fields  # never mistaken for a per-token numeric field
