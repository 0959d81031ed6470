"""Agent traces (OpenAI-style chat transcripts) -> rollouts with loss masks, through the model's own chat template.

A trace is one JSONL line:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "...", "tool_calls": [...]}, ...],
     "tools": [...], "advantage": 0.5}

(`tools`: the JSON schemas the chat template renders, optional; `advantage`, `pair`, `chosen`: copied onto the
rollout). The conversation is tokenised by transformers' `apply_chat_template` (tools included), and becomes one
rollout: the prompt is everything before the first assistant turn (with the template's generation prompt), the
response everything after it, with loss_mask 1 on the tokens of assistant turns (through the end-of-turn token)
and 0 on everything else (tool outputs, user turns, the template's own markup between turns).

Re-tokenisation drift (slime #2263, ms-swift #10012, NeMo-Gym #1416): templates often render an earlier turn
differently once later turns exist (e.g. Qwen3 drops an earlier turn's reasoning), so training on the whole
conversation would put tokens in front of a turn that the policy never saw when it produced that turn. Every
assistant turn k is checked: the conversation up to k with the generation prompt (what the policy was given) and
up to k inclusive (what it produced) must both be token prefixes of the whole conversation. Otherwise the trace is
refused in one line naming its file:line, the turn and the first token that differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_branch.data.rollouts import Rollout, iter_jsonl
from megatron_branch.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
_COPIED = ("advantage", "pair", "chosen")


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise UserError("field 'messages' must be a non-empty list of chat messages", where=where)
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise UserError(f"message {k} must be an object, got {type(m).__name__}", where=where)
        if m.get("role") not in ROLES:
            raise UserError(
                f"message {k} has role {m.get('role')!r}; roles are {', '.join(ROLES)}", where=where
            )
        content = m.get("content")
        if not (isinstance(content, str) or (content is None and m["role"] == "assistant")):
            raise UserError(f"message {k} ({m['role']}): content must be a string", where=where)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError("the trace has no assistant message: nothing to train", where=where)
    return [dict(m) for m in messages]


def _ids(
    tokenizer: Any, messages: list[dict], tools: Any, *, generation_prompt: bool, where: str
) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # jinja and transformers raise many kinds; the user needs one line
        raise UserError(f"the chat template fails: {str(exc).splitlines()[0]}", where=where) from None
    if isinstance(out, Mapping):  # newer transformers return a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _turn_end(span: Sequence[int], end_id: int | None) -> int:
    """Length of an assistant turn's trained part: through its LAST end-of-turn token (the markup the template puts
    after it, e.g. a newline, was not generated); the whole span when the template emits none."""
    if end_id is None or end_id not in span:
        return len(span)
    return len(span) - list(reversed(span)).index(end_id)


def trace_to_rollout(
    obj: Any, tokenizer: Any, *, where: str = "trace", end_token_id: int | None = None
) -> Rollout:
    """One trace (a JSON object, module doc) -> a Rollout with loss_mask 1 on the assistant turns' tokens.
    `end_token_id`: the end-of-turn token (default: the tokenizer's eos)."""
    if not isinstance(obj, Mapping):
        raise UserError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    messages = _check_messages(obj.get("messages"), where)
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise UserError("field 'tools' must be a list of tool schemas", where=where)
    end_id = tokenizer.eos_token_id if end_token_id is None else end_token_id
    full = _ids(tokenizer, messages, tools, generation_prompt=False, where=where)
    trained = [False] * len(full)
    prompt_len = None
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        given = _ids(tokenizer, messages[:k], tools, generation_prompt=True, where=where)
        produced = _ids(tokenizer, messages[: k + 1], tools, generation_prompt=False, where=where)
        for what, ids in (("the context it was given", given), ("its own tokens", produced)):
            if full[: len(ids)] != ids:
                j = _first_difference(ids, full)
                raise UserError(
                    f"turn {k} (assistant): the chat template renders {what} differently once later turns are "
                    f"added (first difference at token {j}); training would see tokens the policy never saw",
                    where=where,
                )
        if len(produced) <= len(given):
            raise UserError(f"turn {k} (assistant) renders to no tokens of its own", where=where)
        span = produced[len(given) :]
        stop = len(given) + _turn_end(span, end_id)
        trained[len(given) : stop] = [True] * (stop - len(given))
        prompt_len = len(given) if prompt_len is None else prompt_len
    assert prompt_len is not None
    return Rollout(
        prompt=full[:prompt_len],
        response=full[prompt_len:],
        loss_mask=trained[prompt_len:],
        where=where,
        **{key: obj[key] for key in _COPIED if key in obj},
    )


def read_traces_jsonl(path: str | Path, tokenizer: Any, **kw: Any) -> list[Rollout]:
    """Every trace of a JSONL file as a rollout (`trace_to_rollout`); a problem is one UserError naming path:line."""
    rollouts = [
        trace_to_rollout(obj, tokenizer, where=where, **kw) for obj, where in iter_jsonl(path, "trace")
    ]
    if not rollouts:
        raise UserError("no traces", where=str(path))
    return rollouts
