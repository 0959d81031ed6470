"""verl's micro-batches <-> one prefix tree, and the linear objective that carries verl's loss gradient into it.

Shape legend: B rollouts of one micro-batch, N tokens of all its sequences packed without padding (verl's
"no padding" layout: `input_ids` is a jagged nested tensor [B, j]), P packed tokens of the prefix tree.

verl's layout (verl/models/mcore/model_forward.py + workers/utils/padding.py): a model output `log_probs` is a nested
tensor like `input_ids`; its value at flat position n is the log-probability of token n + 1 of the same sequence
(the label is the input rolled by one), and `no_padding_2_padding` reads rollout i's response from the slots
[end_i - R_i - 1, end_i - 1). `entropy` sits in the same slots (the entropy of the distribution that predicted the
token). So a response token is identified by its logprob SLOT; `TreeSlots` maps every slot of every micro-batch to
the tree's packed token with the same (rollout, position).

Exactness (docs/verl.md): verl's loss L is a function of the response slots' logprobs (and entropies). With the
tree's forward-only values at those slots, g = dL/dlogp and h = dL/dentropy (autograd through verl's own loss,
the values being leaves) give the gradient dL/dtheta = sum_slots g dlogp/dtheta + h dH/dtheta: one gradient pass
of the tree with the linear objective `LinearSlotObjective` below. A token shared by k rollouts appears once in the
tree; its weight is the sum of the k rollouts' slot gradients (its logprob and entropy are the same in all of
them, being functions of the shared prefix only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_branch.data import PrefixTree, Rollout

_NO_STATS = torch.zeros(0, dtype=torch.float64)


def _lengths(micro_batch: object) -> tuple[list[int], list[int]]:
    """(sequence length, response length) of each rollout of a verl micro-batch, as `no_padding_2_padding`
    counts them (nested prompts/responses, or the left/right-padded attention mask)."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]  # type: ignore[index]
    if prompts.is_nested:
        p = prompts.offsets().diff()
        r = responses.offsets().diff()
    else:
        mask = micro_batch["attention_mask"]  # type: ignore[index]
        p = mask[:, : prompts.shape[1]].sum(dim=1)
        r = mask[:, prompts.shape[1] :].sum(dim=1)
    return (p + r).tolist(), r.tolist()


@dataclass(kw_only=True)
class TreeSlots:
    """Every micro-batch's rollouts, the tree over all of them, and slot <-> tree-token maps."""

    tree: PrefixTree
    rollout_offset: list[int]
    """First tree rollout of each micro-batch (the tree's rollouts are the micro-batches' in order)."""
    offsets: list[torch.Tensor]
    """Per micro-batch: [B + 1] the nested input's offsets (verl's packing of that micro-batch)."""
    slots: list[torch.Tensor]
    """Per micro-batch: [S] flat slot of every response token (rollout order, then position)."""
    tokens: list[torch.Tensor]
    """Per micro-batch: [S] the tree's packed token of the same (rollout, position)."""

    @classmethod
    def build(
        cls,
        micro_batches: list[object],
        *,
        vocab_size: int,
        routes: list[list[torch.Tensor]] | None = None,
    ) -> TreeSlots:
        """`routes`: per micro-batch, per rollout, its recorded experts [n, MoE layers, k] (-1: route natively), for
        routing replay (verl_moe.py r3_routes): the tree then shares a position only where the records agree."""
        rollouts: list[Rollout] = []
        first, offsets, slot_rows, spans = [], [], [], []
        for mb in micro_batches:
            ids = mb["input_ids"]  # type: ignore[index]
            assert ids.is_nested, "verl's no-padding layout: input_ids is a nested tensor"
            off = ids.offsets().cpu()
            values = ids.values().cpu().tolist()
            seq_lens, resp_lens = _lengths(mb)
            assert off.diff().tolist() == seq_lens, "input_ids do not match prompts + responses"
            first.append(len(rollouts))
            rows = []
            for b, (n, r) in enumerate(zip(seq_lens, resp_lens)):
                start = int(off[b])
                seq = values[start : start + n]
                assert n - r > 0, "verl needs a non-empty prompt (no_padding_2_padding)"
                rec = routes[len(first) - 1][b] if routes is not None else None
                rollouts.append(Rollout(prompt=seq[: n - r], response=seq[n - r :], routed_experts=rec))
                rows.append(torch.arange(start + n - r - 1, start + n - 1))  # logprob slots of the response
            offsets.append(off)
            slot_rows.append(torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long))
            spans.append(len(rollouts))
        tree = PrefixTree.build(rollouts, vocab_size=vocab_size)
        tokens = []
        for k, lo in enumerate(first):
            idx = [tree.response_indices(i) for i in range(lo, spans[k])]
            tokens.append(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long))
            assert len(tokens[-1]) == len(slot_rows[k])
        return cls(tree=tree, rollout_offset=first, offsets=offsets, slots=slot_rows, tokens=tokens)

    def nested(self, k: int, per_token: torch.Tensor, *, dtype: torch.dtype, device: object) -> torch.Tensor:
        """Micro-batch k's values [N] (leaf-able) in verl's layout: the tree's per-packed-token values
        `per_token` [P] at the response slots, 0 at the other slots (prompt positions and each sequence's last
        slot, which verl fills and nothing reads)."""
        off = self.offsets[k]
        flat = torch.zeros(int(off[-1]), dtype=dtype)
        flat[self.slots[k]] = per_token[self.tokens[k]].to(dtype)
        return flat.to(device)

    def as_nested(self, k: int, flat: torch.Tensor) -> torch.Tensor:
        """[N] values of micro-batch k -> verl's jagged nested tensor [B, j] (a view: gradients reach `flat`)."""
        return torch.nested.nested_tensor_from_jagged(flat, offsets=self.offsets[k].to(flat.device))

    def tree_weights(self, k: int, slot_grad: torch.Tensor, into: torch.Tensor) -> None:
        """Add micro-batch k's slot gradients [N] to the tree's per-token weights `into` [P] (shared tokens sum)."""
        into.index_add_(0, self.tokens[k], slot_grad.detach().cpu().to(into.dtype)[self.slots[k]])


@dataclass(frozen=True, kw_only=True)
class LinearSlotObjective:
    """J = sum_p G[p] * logp(p) + H[p] * entropy(p) over the tree's packed tokens p: the linearisation of verl's
    loss at the forward-only pass (module doc). `G`, `H` [P] float64; `H` None when the loss reads no entropy."""

    G: torch.Tensor
    H: torch.Tensor | None = None

    def bind(self, tree: PrefixTree) -> _BoundLinearSlot:
        assert len(self.G) == tree.num_tokens and (self.H is None or len(self.H) == tree.num_tokens)
        return _BoundLinearSlot(self, tree)


class _BoundLinearSlot:
    stat_names: tuple[str, ...] = ()

    def __init__(self, objective: LinearSlotObjective, tree: PrefixTree) -> None:
        self.G, self.H, self.tree = objective.G, objective.H, tree
        self.needs_entropy = objective.H is not None

    def _dot(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x * w.to(device=x.device, dtype=x.dtype)).sum()

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = targets.cpu()
        loss = self._dot(self.G[t], logp)
        if self.H is not None:
            assert entropy is not None, "the schedule did not compute the entropy the objective needs"
            loss = loss + self._dot(self.H[t], entropy)
        return loss, _NO_STATS

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The naive schedule's form: rollout i alone, logp[j] = logprob of its token j + 1. A token shared by k
        rollouts carries the SUM of their weights in G, so each rollout here takes its 1/k share (the sum over
        rollouts is J again)."""
        r = self.tree.rollouts[i]
        idx = self.tree.response_indices(i)
        share = self.tree.token_weights(torch.ones(len(self.tree.rollouts), dtype=torch.float64))[idx]
        w = torch.zeros(len(r.prompt) + len(r.response) - 1, dtype=torch.float64)
        w[len(r.prompt) - 1 :] = self.G[idx] / share
        loss = self._dot(w, logp)
        if self.H is not None:
            assert entropy is not None
            h = torch.zeros_like(w)
            h[len(r.prompt) - 1 :] = self.H[idx] / share
            loss = loss + self._dot(h, entropy)
        return loss, _NO_STATS
