"""The decode-time K/V cache: each prompt's K/V kept once, each branch's own tokens in a shared buffer, and the
BranchContext a decode step attaches to the model.

SHAPE LEGEND (Megatron sequence-first at the boundary; per TP rank):
    s  query rows of a decode step: one per live branch (A of them), plus padding under sequence parallel
    P  tokens of one prompt        B  rows of the branch buffer (every generated token's slot, all prompts)
    L  longest branch path (its generated tokens, itself included)
    n  query heads, g kv groups, r = n // g query heads per group, h head dim
    model side:    q [s,1,n,h]   k, v [s,1,g,h]   out [s,1,n*h]
    cache:         prompt k/v [1,g,P,h] per prompt per layer (the fused kernels' layout, made once at prefill)
                   buffer k/v [g,B,h] per layer

A decode step is the prefix tree's own picture: every branch is a length-1 query segment whose ancestors are its
prompt and the generated tokens above it. The attention uses that structure directly, in two parts merged by the
engine's one log-sum-exp merge (attention/merge.py):
    part A  all branches vs their prompts' K/V through the attention backend's EXECUTOR (attention/executor.py,
            the contract training uses; the sampler's `backend`): one key block per live prompt, read in place,
            and a plan (attention/plan.py) in which the branches of prompt p are one full group -- for `merge`
            ONE fused non-causal call per prompt and layer, GQA folded, no expanded copy of the prompt;
    part B  each branch vs its own generated tokens (its path in the buffer, itself included): one batched,
            masked matmul over [A, L] for all branches (a tree-sampled shared response prefix is gathered per
            branch here; it is short, the prompt is not).
RoPE is applied by the model at each token's true position (the position ids of the step), before K/V are cached.

A hybrid's gated delta net layers keep no K/V: they keep a STATE TABLE per layer (`PrefixKV.states`: the recurrent
state S [R, H, dk, dv] and conv tail [R, cd, K-1], one row per prompt after prefill, one row per fed branch after
a decode step). A decode step is a 1-token segment per branch continuing from its row of the table
(`DecodeStep.state_rows`; the model's BranchGatedDeltaNet reads it through `handed_down`): each prompt's state is
computed once by prefill, and a fork just points its children at the same row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_branch.attention.context import BranchContext
from megatron_branch.attention.dispatch import plan_executor
from megatron_branch.attention.kernels import lse_dtype
from megatron_branch.attention.merge import add_sink, lse_merge
from megatron_branch.attention.plan import BlockPlan, Runs, plan_block
from megatron_branch.attention.prefix_state import (
    ATTENTION_KV,
    CACHED,
    ChunkSegment,
    ChunkTree,
    Handoff,
    StateKind,
    Tensors,
)


@dataclass(kw_only=True)
class PrefixKV:
    """Per layer: each prompt's K/V ([1,g,P,h], root of every branch of that prompt) and the branch buffer."""

    prompt_k: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """layer -> [prompt p -> k [1,g,P_p,h]] (contiguous, post-RoPE)."""
    prompt_v: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    buffer_k: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer -> [g,B,h]: row b holds the K of the generated token assigned slot b."""
    buffer_v: dict[int, torch.Tensor] = field(default_factory=dict)
    buffer_rows: int = 0
    """B."""
    states: dict[int, Tensors] = field(default_factory=dict)
    """layer -> a recurrent layer's state table (gated delta net: S [R,H,dk,dv], tail [R,cd,K-1]): one row per
    prompt after prefill, then one row per branch fed by the last decode step."""

    def add_prompts(self, captured: dict[int, Handoff], spans: list[tuple[int, int]]) -> None:
        """Keep one prefill forward's captured K/V ([S,1,g,h] per layer) as one block per prompt, spans[p] =
        (start, end) rows, and a recurrent layer's state after each prompt (one row per prompt); prompts are
        numbered in the order they are added. The prefill's tensors can go."""
        for layer, handoff in captured.items():
            if handoff.kind is not ATTENTION_KV:  # the state at each prompt's end, one row per prompt
                new, held = handoff.tensors, self.states.get(layer)
                self.states[layer] = new if held is None else tuple(torch.cat(p) for p in zip(held, new))
                continue
            k, v = handoff.tensors
            self.prompt_k.setdefault(layer, []).extend(_internal(k[a:b]) for a, b in spans)
            self.prompt_v.setdefault(layer, []).extend(_internal(v[a:b]) for a, b in spans)

    def allocate_buffer(self, rows: int) -> None:
        """The branch buffer: `rows` slots for generated tokens, shared by all branches of all prompts."""
        self.buffer_rows = rows
        for layer, ks in self.prompt_k.items():
            _, g, _, h = ks[0].shape
            self.buffer_k[layer] = ks[0].new_zeros(g, rows, h)
            self.buffer_v[layer] = ks[0].new_zeros(g, rows, self.prompt_v[layer][0].shape[-1])  # MLA: v's

    def num_prompt_rows(self, p: int) -> int:
        first = next(iter(self.prompt_k.values()))
        return first[p].shape[2]


def _internal(x: torch.Tensor) -> torch.Tensor:
    """[P,1,g,h] -> [1,g,P,h] contiguous (once per prompt)."""
    return x.permute(1, 2, 0, 3).contiguous()


@dataclass(kw_only=True)
class DecodeStep:
    """Where the A branches of one decode step read and write (host tensors, built by the sampler)."""

    prompt_of: torch.Tensor
    """[A] prompt index of each branch."""
    slot: torch.Tensor
    """[A] buffer row that receives each branch's new K/V."""
    path: torch.Tensor
    """[A, L] buffer rows of each branch's generated tokens, root first, ending with `slot` (padded with 0)."""
    path_len: torch.Tensor
    """[A] valid entries of `path`."""
    state_rows: torch.Tensor | None = None
    """[A] row of the state table (PrefixKV.states) each branch continues from (hybrids; None without)."""
    padded_rows: int = 0
    """Extra query rows (sequence parallel needs s % tp == 0); they attend to nothing and return 0."""
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(prompt p, [a_p] rows of its branches) for every prompt with live branches; derived from `prompt_of`."""

    def __post_init__(self) -> None:
        if not self.groups:
            self.groups = [
                (p, torch.nonzero(self.prompt_of == p).squeeze(1))
                for p in torch.unique(self.prompt_of).tolist()
            ]

    @property
    def num_branches(self) -> int:
        return int(self.slot.numel())

    def to(self, device: torch.device) -> DecodeStep:
        return DecodeStep(
            prompt_of=self.prompt_of.to(device),
            slot=self.slot.to(device),
            path=self.path.to(device),
            path_len=self.path_len.to(device),
            state_rows=None if self.state_rows is None else self.state_rows.to(device),
            padded_rows=self.padded_rows,
        )


@dataclass(kw_only=True)
class DecodeContext:
    """The branch context (attention/context.py) of one decode step: reads the prompts' K/V in place, writes each
    branch's new K/V into the buffer. Forward only: it captures nothing and is never recomputed."""

    cache: PrefixKV
    step: DecodeStep
    capture: bool = True  # a recurrent layer hands each branch's new state down (`next_states`)
    captured: dict[int, Handoff] = field(default_factory=dict)
    recompute_layers: bool = False
    tree: ChunkTree | None = None
    """Each branch a 1-row segment continuing from a cached parent (its row of the state table)."""
    exchange: None = None
    """Decoding runs on one rank: no head exchange."""
    next_states: dict[int, Tensors] = field(default_factory=dict)
    """layer -> the state table after this step (one row per branch fed), for a recurrent layer."""
    backend: str | None = None
    """The attention backend whose executor runs part A (attention/dispatch.py plan_executor; None, or a one-rank
    baseline without an executor: the default)."""
    _plan: BlockPlan | None = field(default=None, repr=False)
    """Part A's plan: the same for every layer of the step, built once."""

    def __post_init__(self) -> None:
        if self.tree is None:
            a = self.step.num_branches
            self.tree = ChunkTree(segments=tuple(ChunkSegment(i, i + 1, CACHED) for i in range(a)))

    def hand_down(self, layer_number: int, kind: StateKind, tensors: Tensors) -> None:
        """A recurrent layer's state after this step's token, one row per branch (attention's new K/V go into the
        branch buffer in `attend` instead)."""
        self.next_states[layer_number] = tuple(tensors)

    def handed_down(self, layer_number: int) -> list[Tensors]:
        """A recurrent layer's state each branch continues from: its row of the state table."""
        assert self.step.state_rows is not None, "a recurrent layer in decode needs DecodeStep.state_rows"
        return [tuple(t[self.step.state_rows] for t in self.cache.states[layer_number])]

    def for_recompute(self) -> BranchContext:
        raise AssertionError("a decode step runs without grad: nothing is recomputed")

    def attend(
        self,
        layer_number: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [s,1,n,h], k/v [s,1,g,h] -> [s,1,n*h]. With a sliding `window` (path positions: a branch's query at
        P + l - 1, its prompt's keys at 0..P-1, its own at P..P+l-1) both parts mask the keys it no longer sees
        (part A then runs as a masked matmul per prompt, not through the executor); a `sink` [n] joins each row's
        softmax once, after the merge (attention/merge.py add_sink)."""
        st, a = self.step, self.step.num_branches
        s, b, n, h = q.shape
        g = k.shape[2]
        r = n // g
        assert b == 1 and s == a + st.padded_rows, (q.shape, a, st.padded_rows)
        bk, bv = self.cache.buffer_k[layer_number], self.cache.buffer_v[layer_number]  # [g,B,h]
        bk[:, st.slot] = k[:a, 0].transpose(0, 1).to(bk.dtype)  # the new tokens' K/V join their branches
        bv[:, st.slot] = v[:a, 0].transpose(0, 1).to(bv.dtype)
        acc = lse_dtype(q.dtype)

        # part B: each branch over its own generated tokens (path rows, itself last), masked to its length
        kp, vp = bk[:, st.path], bv[:, st.path]  # [g,A,L,h]
        qb = q[:a, 0].reshape(a, g, r, h).permute(1, 0, 2, 3).to(acc)  # [g,A,r,h]: head j = (j // r, j % r)
        scores = torch.matmul(qb, kp.to(acc).transpose(-1, -2)) * scale  # [g,A,r,L]
        col = torch.arange(st.path.shape[1], device=q.device)[None, :]  # [1,L]
        valid = col < st.path_len[:, None]  # [A,L]
        if window is not None:  # the branch's own tokens more than W - 1 positions back drop out
            valid &= col >= st.path_len[:, None] - window
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)  # [g,A,r]; finite: a branch always sees itself
        out_b = torch.matmul(torch.exp(scores - lse_b[..., None]), vp.to(acc))  # [g,A,r,h]

        # part A: every branch over its prompt's K/V, read in place, through the backend's executor
        if window is None:
            out_a, lse_a = self._prompt_part(layer_number, q[:a], scale)
        else:
            out_a, lse_a = self._windowed_prompt_part(layer_number, qb, scale, window)

        out, lse = lse_merge(out_a, lse_a, out_b, lse_b)  # [g,A,r,h], [g,A,r]
        out = out.permute(1, 0, 2, 3)  # [A,g,r,hv]
        if sink is not None:  # once per row, after both parts: [A,1,n,hv], [A,1,n]
            out, _ = add_sink(out.reshape(a, 1, n, -1), lse.permute(1, 0, 2).reshape(a, 1, n), sink)
        out = out.reshape(a, 1, -1).to(q.dtype)  # [A,1,n*hv]
        if st.padded_rows:
            out = torch.cat([out, out.new_zeros(st.padded_rows, 1, out.shape[-1])])
        return out

    def _prompt_part(
        self, layer_number: int, q: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Part A through the executor: q [A,1,n,h] -> (out [g,A,r,hv], lse [g,A,r]) in the accumulation dtype."""
        st, (a, _, n, _) = self.step, q.shape
        g = self.cache.prompt_k[layer_number][0].shape[1]
        prompts = [p for p, _ in st.groups]
        ks = [self.cache.prompt_k[layer_number][p].permute(2, 0, 1, 3) for p in prompts]  # [P,1,g,h] views
        vs = [self.cache.prompt_v[layer_number][p].permute(2, 0, 1, 3) for p in prompts]
        if self._plan is None:
            self._plan = prompt_plan(st, [k.shape[0] for k in ks])
        o, lse = plan_executor(self.backend).forward(q, ks, vs, self._plan, scale)  # [A,1,n,h], [A,1,n] acc
        acc = lse_dtype(q.dtype)
        out_a = o.reshape(a, g, n // g, -1).permute(1, 0, 2, 3).to(acc)  # [g,A,r,hv] (hv: v's width)
        return out_a, lse.reshape(a, g, n // g).permute(1, 0, 2).to(acc)  # [g,A,r]

    def _windowed_prompt_part(
        self, layer_number: int, qb: torch.Tensor, scale: float, window: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Part A under a sliding window, per prompt a masked matmul: qb [g,A,r,h] (acc) -> (out [g,A,r,hv],
        lse [g,A,r], -inf where a branch's window has left its prompt). Branch i's query sits at path position
        P + path_len_i - 1, so it sees prompt key j iff P + path_len_i - 1 - j < window."""
        st = self.step
        g, a, r, _ = qb.shape
        hv = self.cache.prompt_v[layer_number][0].shape[-1]
        out = qb.new_zeros(g, a, r, hv)
        lse = qb.new_full((g, a, r), float("-inf"))
        for p, rows in st.groups:
            k = self.cache.prompt_k[layer_number][p][0].to(qb.dtype)  # [g,P,h]
            v = self.cache.prompt_v[layer_number][p][0].to(qb.dtype)  # [g,P,hv]
            plen = k.shape[1]
            scores = torch.einsum("garh,gph->garp", qb[:, rows], k) * scale  # [g,a_p,r,P]
            first = plen + st.path_len[rows] - window  # [a_p]: the first prompt key still in the window
            seen = torch.arange(plen, device=qb.device)[None, :] >= first[:, None]  # [a_p,P]
            scores = scores.masked_fill(~seen[None, :, None, :], float("-inf"))
            part = torch.logsumexp(scores, dim=-1)  # [g,a_p,r]; -inf where nothing is seen
            probs = torch.exp(scores - torch.where(part.isinf(), 0.0, part)[..., None])  # 0 where unseen
            out[:, rows] = torch.einsum("garp,gpv->garv", probs, v)
            lse[:, rows] = part
        return out, lse


def prompt_plan(step: DecodeStep, prompt_sizes: list[int]) -> BlockPlan:
    """Part A's visibility: query row i (branch i) sees, in full, the key block of its prompt (block j = the j-th
    entry of step.groups, prompt_sizes[j] keys). Through THE planner, so every executor (flex's mask included)
    reads it; the branches of one prompt see the same columns and become one full group."""
    a = step.num_branches
    block_of = [0] * a
    for j, (_, rows) in enumerate(step.groups):
        for i in rows.tolist():
            block_of[i] = j
    starts = [sum(prompt_sizes[:j]) for j in range(len(prompt_sizes))]
    # query segments 0..A-1 (one per branch); key segments A + j (key-only ids: no query shares them)
    q = Runs(start=tuple(range(a)), length=(1,) * a, segment=tuple(range(a)), offset=(0,) * a)
    k = Runs(
        start=tuple(starts),
        length=tuple(prompt_sizes),
        segment=tuple(a + j for j in range(len(prompt_sizes))),
        offset=(0,) * len(prompt_sizes),
    )
    return plan_block(q, k, [(block_of[i],) for i in range(a)], a, prompt_sizes)
