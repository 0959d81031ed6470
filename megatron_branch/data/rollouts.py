"""The `Rollout` record and its JSONL file format.

A rollout is one sampled sequence: the prompt it was sampled from, the response the policy produced, its
advantage, and optional per-response-token values (old log-probabilities for PPO, reference log-probabilities
for KL, ...). Every other part of the package sees rollouts only through `PrefixTree`, which is built from them;
this file owns the validation, so a malformed rollout fails here, once, with a one-line message saying where.

JSONL format, one rollout a line (blank lines skipped):

    {"prompt": [ids], "response": [ids], "advantage": 0.5, "old_logprobs": [floats, one per response token]}

`advantage` (a float) is what the policy objectives need unless `advantages` (one per response token) is given;
DPO rollouts carry `pair` (any JSON scalar shared by the two rollouts of a pair) and `chosen` (true/false) instead.
The per-token fields the objectives read (`TOKEN_FIELDS`: advantages, old_logprobs, ref_logprobs, rollout_logprobs
(the inference engine's own, for rollout correction), rewards, values, returns) must be finite. Each rollout remembers where it came from (`where`, file:line), so an objective that finds a field
missing names the line.

`routed_experts` (MoE routing replay, recorded by the sampler) is one entry per token of prompt + response, each a
list per MoE layer of the k experts the token was routed to (-1: not recorded, e.g. the last sampled token, which
the sampler never feeds); rollouts with records share a prefix-tree position only where the records agree.

`loss_mask` (optional) is one 0/1 (or false/true) per response token: 1 = trained, 0 = context inside the response
(a tool's output, a user turn: it stays in the sequence and conditions later tokens, but carries no loss term and
counts in no token count). Absent (or all ones) = every response token is trained. Per-token fields still hold
one value per response token; values at masked positions are never read.

Any other key whose value is a non-empty list of numbers is a per-response-token field and must have one value
per response token (a misaligned list is an error rather than silently dropped: it would train on wrong data).
Other keys (scalars, strings, lists of non-numbers, empty lists) are ignored, so rollout files may carry metadata.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_branch.errors import UserError
from megatron_branch.outputs import write_text

if TYPE_CHECKING:
    import torch

_REQUIRED = ("prompt", "response")
_SCALARS = ("advantage", "pair", "chosen")  # top-level keys that are not per-token fields
LOSS_MASK = "loss_mask"
TOKEN_FIELDS = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "rewards",
    "values",
    "returns",
)
"""Per-response-token fields the objectives read (others are carried along untouched)."""


def _is_number(value: Any) -> bool:
    # bool is an int subclass in Python; True as a token id or an advantage is always a bug in the producer.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_token_ids(
    values: Any, *, name: str, where: str, vocab_size: int | None = None
) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints >= 0 (and < vocab_size when given), else a one-line UserError."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # torch tensors and numpy arrays
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise UserError(f"{name} must be a list of token ids, got {type(values).__name__}", where=where)
    # Fast path (C-speed scans): the common case of plain non-negative Python ints.
    if all(type(v) is int for v in values) and (not values or min(values) >= 0):
        ids = tuple(values)
    else:
        converted = []
        for j, v in enumerate(values):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise UserError(f"{name} token {j} is {v!r}: token ids must be ints >= 0", where=where)
            iv = operator.index(v)
            if iv < 0:
                raise UserError(
                    f"{name} token {j} is negative ({iv}): token ids must be ints >= 0", where=where
                )
            converted.append(iv)
        ids = tuple(converted)
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        j = next(j for j, v in enumerate(ids) if v >= vocab_size)
        raise UserError(
            f"{name} token {j} is id {ids[j]}, out of range for vocab_size {vocab_size}", where=where
        )
    return ids


def _per_token_list(values: Any, *, key: str, of: str, num_response: int, where: str) -> Sequence[Any]:
    """`values` as a list of one entry per response token (tensors and arrays converted), else a one-line
    UserError naming field `key` (`of`: what its entries are, for the message)."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # torch tensors and numpy arrays
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        got = "null" if values is None else type(values).__name__
        raise UserError(
            f"field {key!r} must be a list of {of} (one per response token), got {got}", where=where
        )
    if len(values) != num_response:
        raise UserError(
            f"field {key!r} has {len(values)} values but the response has {num_response} tokens "
            "(length mismatch)",
            where=where,
        )
    return values


def validate_loss_mask(values: Any, *, num_response: int, where: str) -> tuple[bool, ...] | None:
    """`loss_mask` as a tuple of bools, one per response token (None when every token is trained: the absent
    mask's meaning, so an all-ones mask runs exactly as no mask), else a one-line UserError naming the field."""
    values = _per_token_list(values, key=LOSS_MASK, of="0/1", num_response=num_response, where=where)
    for j, v in enumerate(values):
        # exactly 0, 1, false or true: 2, 0.5, -1, 1.0, "1", null or a list is a producer's bug, not a weight
        if not (isinstance(v, bool) or (type(v) is int and v in (0, 1))):
            raise UserError(
                f"field 'loss_mask' value {j} is {json.dumps(v) if _jsonable(v) else repr(v)}: "
                "must be 0, 1, false or true",
                where=where,
            )
    mask = tuple(bool(v) for v in values)
    return None if all(mask) else mask


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _validate_token_fields(fields: Any, *, num_response: int, where: str) -> dict[str, tuple[float, ...]]:
    if not isinstance(fields, Mapping):
        raise UserError(f"token_fields must be a mapping, got {type(fields).__name__}", where=where)
    out: dict[str, tuple[float, ...]] = {}
    for key, values in fields.items():
        if not isinstance(key, str):
            raise UserError(f"token_fields key {key!r} must be a string", where=where)
        values = _per_token_list(values, key=key, of="numbers", num_response=num_response, where=where)
        for j, v in enumerate(values):
            if not _is_number(v):
                raise UserError(f"field {key!r} value {j} is {v!r}, not a number", where=where)
            if key in TOKEN_FIELDS and not math.isfinite(v):
                raise UserError(f"field {key!r} value {j} is {v!r}, not a finite number", where=where)
        out[key] = tuple(float(v) for v in values)
    return out


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One sampled sequence. Lists (and tensors) are accepted and stored as tuples."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    advantage: float | None = None
    """The rollout's scalar advantage (None: not given; the policy objectives then need `advantages`)."""
    # Per-response-token values (e.g. old logprobs for PPO), each with one value per response token.
    token_fields: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    pair: str | int | float | bool | None = None
    """DPO: the key shared by the two rollouts of a preference pair."""
    chosen: bool | None = None
    """DPO: whether this rollout is the pair's preferred one."""
    loss_mask: tuple[bool, ...] | None = None
    """Per response token: True = trained, False = context inside the response (no loss term, in no token count);
    None = every token trained (an all-ones mask is stored as None). Lists of 0/1 are accepted."""
    where: str | None = field(default=None, compare=False)
    """Where it was read from (file:line), for error messages."""
    routed_experts: Any = field(default=None, compare=False)
    """MoE routing replay: int tensor [len(prompt) + len(response), MoE layers, k] of the experts each token was
    routed to when sampled (-1 = not recorded); None = no record. Lists are accepted."""

    def __post_init__(self) -> None:
        where = self.where or "rollout"
        prompt = validate_token_ids(self.prompt, name="prompt", where=where)
        response = validate_token_ids(self.response, name="response", where=where)
        # An empty prompt is fine (the sequence is still non-empty); an empty response has nothing to train on.
        if not response:
            raise UserError("response is empty", where=where)
        if self.advantage is not None and (
            not _is_number(self.advantage) or not math.isfinite(self.advantage)
        ):
            raise UserError(f"advantage must be a finite number, got {self.advantage!r}", where=where)
        if self.pair is not None and not isinstance(self.pair, (str, int, float, bool)):
            raise UserError(f"pair must be a JSON scalar, got {type(self.pair).__name__}", where=where)
        if self.chosen is not None and not isinstance(self.chosen, bool):
            raise UserError(f"chosen must be true or false, got {self.chosen!r}", where=where)
        fields = _validate_token_fields(self.token_fields, num_response=len(response), where=where)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "response", response)
        if self.advantage is not None:
            object.__setattr__(self, "advantage", float(self.advantage))
        object.__setattr__(self, "token_fields", fields)
        if self.loss_mask is not None:
            mask = validate_loss_mask(self.loss_mask, num_response=len(response), where=where)
            object.__setattr__(self, "loss_mask", mask)
        if self.routed_experts is not None:
            object.__setattr__(
                self,
                "routed_experts",
                validate_routed_experts(self.routed_experts, len(prompt) + len(response), where),
            )

    def field(self, name: str) -> tuple[float, ...] | None:
        """Per-response-token field `name`, or None when this rollout has none."""
        return self.token_fields.get(name)

    @property
    def num_trained(self) -> int:
        """Response tokens that carry a loss term (loss_mask 1): what every token count counts."""
        return len(self.response) if self.loss_mask is None else sum(self.loss_mask)

    def trained_positions(self) -> tuple[int, ...] | None:
        """Indices into the response of the trained tokens; None = all of them."""
        return None if self.loss_mask is None else tuple(j for j, m in enumerate(self.loss_mask) if m)

    def describe(self, i: int) -> str:
        """Where this rollout is, for an error message: file:line, else its index."""
        return self.where or f"rollout {i}"

    @property
    def sequence(self) -> tuple[int, ...]:
        """The full token sequence prompt + response."""
        return self.prompt + self.response


def validate_routed_experts(value: Any, num_tokens: int, where: str) -> torch.Tensor:
    """`routed_experts` as an int32 tensor [num_tokens, layers, k] of expert ids >= -1, else a one-line UserError."""
    import torch

    try:
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise UserError(
            "routed_experts must be nested lists [token][layer][k] of expert ids", where=where
        ) from None
    if t.dim() != 3 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise UserError(
            f"routed_experts must be integers shaped [tokens, MoE layers, k], got {t.dtype} {list(t.shape)}",
            where=where,
        )
    if t.shape[0] != num_tokens:
        raise UserError(
            f"routed_experts has {t.shape[0]} entries but prompt + response has {num_tokens} tokens",
            where=where,
        )
    if t.numel() and int(t.min()) < -1:
        raise UserError("routed_experts holds an expert id below -1", where=where)
    return t.to(torch.int32)


def _parse_line(obj: Any, *, where: str, vocab_size: int | None) -> Rollout:
    if not isinstance(obj, dict):
        raise UserError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    for key in _REQUIRED:
        if key not in obj:
            raise UserError(f"missing field {key!r}", where=where)
    prompt = validate_token_ids(obj["prompt"], name="prompt", where=where, vocab_size=vocab_size)
    response = validate_token_ids(obj["response"], name="response", where=where, vocab_size=vocab_size)
    if not response:
        raise UserError("response is empty", where=where)
    advantage = obj.get("advantage")
    if advantage is not None and (not _is_number(advantage) or not math.isfinite(advantage)):
        raise UserError(f"advantage must be a finite number, got {advantage!r}", where=where)
    token_fields: dict[str, Any] = {}
    loss_mask = None
    if LOSS_MASK in obj:  # present: validated even when null (a producer's null is not "absent")
        loss_mask = validate_loss_mask(obj[LOSS_MASK], num_response=len(response), where=where)
    for key, value in obj.items():
        if key in ("routed_experts", LOSS_MASK):
            continue
        if key in TOKEN_FIELDS and not (isinstance(value, list) and all(_is_number(v) for v in value)):
            raise UserError(f"field {key!r} must be a list of numbers, one per response token", where=where)
        if key in _REQUIRED or key in _SCALARS or not isinstance(value, list) or not value:
            continue  # scalars and empty lists are metadata
        if all(_is_number(v) for v in value):
            token_fields[key] = value
    fields = _validate_token_fields(token_fields, num_response=len(response), where=where)
    return Rollout(
        prompt=prompt,
        response=response,
        advantage=advantage,
        token_fields=fields,
        pair=obj.get("pair"),
        chosen=obj.get("chosen"),
        loss_mask=loss_mask,
        where=where,
        routed_experts=obj.get("routed_experts"),
    )


CONTEXT_OVERRIDE_FLAG = "--allow-longer-context"


def check_sequence_length(rollout: Rollout, max_positions: int | None, *, where: str) -> None:
    """Refuse a rollout longer than the model's context (`max_position_embeddings`).

    Positions past the context were never trained: RoPE extrapolates silently and the gradients are of a model
    evaluated where it is not defined. `max_positions=None` skips the check (the explicit override).
    """
    n = len(rollout.prompt) + len(rollout.response)
    if max_positions is not None and n > max_positions:
        raise UserError(
            f"rollout has {n} tokens ({len(rollout.prompt)} prompt + {len(rollout.response)} response), longer "
            f"than the model's context of {max_positions} positions (max_position_embeddings); pass "
            f"{CONTEXT_OVERRIDE_FLAG} to extrapolate RoPE past it",
            where=where,
        )


def check_context(rollouts: Sequence[Rollout], max_positions: int | None, *, where: str = "rollout") -> None:
    """`check_sequence_length` for rollouts that did not come from a file (named `where` + their index)."""
    for i, rollout in enumerate(rollouts):
        check_sequence_length(rollout, max_positions, where=f"{where} {i}")


def iter_jsonl(path: str | Path, what: str) -> Iterator[tuple[Any, str]]:
    """(object, "path:line") for every non-blank line of a JSONL file of `what` (e.g. "rollout"); an unreadable
    file or a line that is not JSON is a one-line UserError naming the file or `path:line`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"cannot read {what} file: {reason}".replace("\n", " "), where=str(path)) from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield json.loads(line), where
        except json.JSONDecodeError as exc:
            raise UserError(f"invalid JSON ({exc.msg} at column {exc.colno})", where=where) from None


def read_rollouts_jsonl(
    path: str | Path, *, vocab_size: int | None = None, max_positions: int | None = None
) -> list[Rollout]:
    """Read rollouts from a JSONL file; any problem is a one-line UserError naming `path:line`.

    `max_positions`: refuse rollouts longer than the model's context (see `check_sequence_length`)."""
    rollouts = []
    for obj, where in iter_jsonl(path, "rollout"):
        rollout = _parse_line(obj, where=where, vocab_size=vocab_size)
        check_sequence_length(rollout, max_positions, where=where)
        rollouts.append(rollout)
    if not rollouts:
        raise UserError("no rollouts", where=str(path))
    return rollouts


def write_rollouts_jsonl(path: str | Path, rollouts: Sequence[Rollout], *, overwrite: bool = True) -> None:
    """Write rollouts in the format `read_rollouts_jsonl` reads (token fields as top-level keys); an existing file
    is replaced (refused with `overwrite=False`), a missing folder refused (outputs.py)."""
    lines = []
    for rollout in rollouts:
        obj: dict[str, Any] = {"prompt": list(rollout.prompt), "response": list(rollout.response)}
        for key in _SCALARS:
            if getattr(rollout, key) is not None:
                obj[key] = getattr(rollout, key)
        for key, values in rollout.token_fields.items():
            if key in _REQUIRED or key in _SCALARS:
                raise UserError(
                    f"token field {key!r} would shadow the required field of that name", where=str(path)
                )
            obj[key] = list(values)
        if rollout.loss_mask is not None:
            obj[LOSS_MASK] = [int(m) for m in rollout.loss_mask]
        if rollout.routed_experts is not None:
            obj["routed_experts"] = rollout.routed_experts.tolist()
        lines.append(json.dumps(obj))
    # replaced whole (temp file + rename, outputs.py): a failure keeps the previous file
    write_text(path, "".join(line + "\n" for line in lines), overwrite=overwrite, what="rollouts file")
