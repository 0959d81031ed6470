"""`BranchSampler`: rollouts from the policy with every prompt prefilled ONCE and its branches decoded together.

Shape legend: S packed prompt tokens of one prefill forward, A live branches of a decode step, h hidden,
v real vocabulary (V/tp on a tensor-parallel rank).

    prefill   the prompts packed into one forward (several when `max_prefill_tokens` says so), each a causal root
              segment of the engine's branch attention (BranchContext + AttentionLayout, positions 0..P-1); each
              layer's K/V is captured and kept per prompt (kv_cache.PrefixKV). The last row's logits give the
              first token of each of the prompt's root branches.
    decode    one forward per step feeds the newest token of every live branch of every prompt, at its true
              position P + t (RoPE follows the position ids, models/rotary.py); attention reads the prompt's K/V in
              place and the branch's own cache (kv_cache.DecodeContext). With `branch_at`, a branch that has
              sampled k tokens forks: its children share its cached tokens and sample their own next tokens from
              the same logits.
Logits are computed only for the rows that predict (the output projection on those hidden states, all-gathered
over TP); every TP rank draws the same tokens (same logits, same generator; broadcast from TP rank 0 to be sure).
The tree of branches itself (forks, finishing, the leaves as samples) is bookkeeping: branches.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.context import BranchContext, LocalContext, attach_context
from megatron_branch.attention.kernels import lse_dtype
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.prefix_state import ChunkSegment, ChunkTree
from megatron_branch.data.rollouts import validate_token_ids
from megatron_branch.errors import UserError
from megatron_branch.generation import multi_turn
from megatron_branch.generation.branches import (
    Branch,
    append_tokens,
    buffer_rows,
    collect_samples,
    prefill_groups,
)
from megatron_branch.generation.kv_cache import DecodeContext, DecodeStep, PrefixKV
from megatron_branch.generation.multi_turn import EnvFactory
from megatron_branch.generation.sampling import choose_tokens
from megatron_branch.generation.types import GenerationOutput, GenerationStats, SamplingParams
from megatron_branch.losses.routing import RoutingRecorder
from megatron_branch.models.gpt import BranchGPTModel
from megatron_branch.models.moe import attach_router_context
from megatron_branch.parallel import lockstep
from megatron_branch.parallel.groups import ParallelGroups, comm_device


class BranchSampler:
    """The built-in `Generator` (types.Generator) on a megatron-core `BranchGPTModel` (models.build_model).

    `groups` (parallel/groups.py) gives the layout; only its TP part matters here (`tp_group` and
    `sequence_parallel` may be given instead by a caller without a ParallelGroups).
    Supported: one rank, or tensor parallel (with or without sequence parallel) over the TP group; every TP rank
    calls `generate` with the same prompts and an identically seeded generator. Context parallel is not used for
    generation: build the sampler on each CP rank and they generate the same samples redundantly (prompts are not
    split over CP). Data parallel: each DP rank samples its own prompts.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int,
        groups: ParallelGroups | None = None,
        tp_group: Any = None,
        sequence_parallel: bool = False,
        max_prefill_tokens: int | None = None,
        backend: str | None = None,
        record_routing: bool = False,
    ) -> None:
        base = getattr(model, "module", model)  # megatron DDP wraps the GPTModel
        if not isinstance(base, BranchGPTModel):
            raise TypeError("BranchSampler needs a BranchGPTModel (megatron_branch.models.build_model)")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if max_prefill_tokens is not None and max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        # the layout comes in whole (preferred); tp_group/sequence_parallel are its TP part
        if groups is not None:
            assert tp_group is None, "pass groups= or tp_group=, not both"
            tp_group, sequence_parallel = groups.tp, groups.sequence_parallel
        self.model, self.base = model, base
        self.vocab_size = vocab_size
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_group = tp_group if self.tp_size > 1 else None  # a size-1 group needs no collectives
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.max_prefill_tokens = max_prefill_tokens
        self.backend = backend
        self.device = next(model.parameters()).device
        arch = getattr(base, "arch", None)
        self.max_positions = arch.max_position_embeddings if arch is not None else base.max_sequence_length
        if record_routing and not getattr(arch, "is_moe", False):
            raise ValueError("record_routing needs a mixture-of-experts policy")
        self.record_routing = record_routing
        self.arch = arch

    # ---- public ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        environments: EnvFactory | None = None,
    ) -> GenerationOutput:
        """`params.n` samples per prompt; `generator` (on the model's device) drives every random draw.
        Multi-turn (`params.multi_turn`): `environments(p)` makes prompt p's environment (multi_turn.py)."""
        t0 = time.perf_counter()
        prompts = self._check_prompts(prompts, params)
        if (params.multi_turn is None) != (environments is None):
            raise ValueError("multi-turn sampling needs both params.multi_turn and environments=, or neither")
        self._environments = environments
        if not params.greedy and generator is None:
            raise ValueError("sampling (temperature > 0) needs a torch.Generator: pass generator=")
        if generator is not None and generator.device.type != self.device.type:
            raise ValueError(
                f"the generator is on {generator.device}, the model on {self.device}: they must match"
            )
        with lockstep.region(
            self.model
        ):  # EP across DP replicas: their forwards pair up (parallel/lockstep.py)
            if not params.share_prefix:
                return self._generate_unshared(prompts, params, generator, t0)
            return self._generate(prompts, params, generator, t0)

    def _generate(
        self,
        prompts: list[tuple[int, ...]],
        params: SamplingParams,
        generator: torch.Generator | None,
        t0: float,
    ) -> GenerationOutput:
        stats = GenerationStats(num_prompts=len(prompts), prompt_prefills=[0] * len(prompts))
        self._prompt_routes: dict[int, torch.Tensor] = {}
        cache = PrefixKV()
        first_logits = self._prefill(prompts, cache, stats)  # [num_prompts, v]
        cache.allocate_buffer(buffer_rows(len(prompts), params))

        # every root branch starts from its prompt's state (row p of the table after prefill)
        roots = [
            [Branch(prompt=p, state_row=p) for _ in range(params.root_fanout)] for p in range(len(prompts))
        ]
        live = [b for group in roots for b in group]
        if self._environments is not None:  # each root its own episode (a fork copies its parent's)
            for b in live:
                multi_turn.start(b, self._environments(b.prompt), prompts[b.prompt])
        self._extend(live, first_logits[torch.tensor([b.prompt for b in live])], params, generator, stats)
        next_slot = 0
        while True:
            feed = [b for b in live if not b.done]
            if not feed:
                break
            for b in feed:
                b.path.append(next_slot)
                next_slot += 1
            logits = self._decode(prompts, feed, cache, stats)  # [A, v]
            live, rows = [], []
            for i, b in enumerate(feed):
                if len(b.tokens) in params.branch_at or multi_turn.forks_at_turn(b):
                    # fork: children share b's tokens (earlier turns included) and cached K/V
                    b.children = [b.fork() for _ in range(params.branch_factor)]
                    live += b.children
                    rows += [i] * params.branch_factor
                else:
                    live.append(b)
                    rows.append(i)
            self._extend(live, logits[torch.tensor(rows)], params, generator, stats)
        assert next_slot <= cache.buffer_rows, (next_slot, cache.buffer_rows)

        samples = [
            collect_samples(
                p,
                prompts[p],
                roots[p],
                params,
                prompt_routes=self._prompt_routes[p] if self.record_routing else None,
            )  # fmt: skip
            for p in range(len(prompts))
        ]
        stats.num_samples = sum(len(g) for g in samples)
        stats.response_tokens = sum(len(s.response) for g in samples for s in g)
        stats.prefill_positions_unshared = params.n * sum(len(p) for p in prompts)
        stats.seconds = time.perf_counter() - t0
        return GenerationOutput(samples=samples, stats=stats)

    def _generate_unshared(
        self,
        prompts: list[tuple[int, ...]],
        params: SamplingParams,
        generator: torch.Generator | None,
        t0: float,
    ) -> GenerationOutput:
        """Every sample its own prefill (an engine without prefix caching): `n` copies of each prompt, one sample
        each. The live branches keep the shared path's order (prompt-major, sample-minor), so every step draws
        from the generator in the same order and the tokens are the same; only the work differs (n x prefill
        positions, n copies of each prompt's K/V)."""
        n = params.n
        copies = [p for p in prompts for _ in range(n)]
        envs = self._environments
        out = self.generate(
            copies, dataclasses.replace(params, n=1, share_prefix=True), generator=generator,
            environments=None if envs is None else lambda i: envs(i // n),
        )  # fmt: skip
        samples = [
            [dataclasses.replace(g[0], prompt_index=p) for g in out.samples[p * n : (p + 1) * n]]
            for p in range(len(prompts))
        ]
        stats = out.stats
        stats.num_prompts = len(prompts)
        stats.prompt_prefills = [sum(stats.prompt_prefills[p * n : (p + 1) * n]) for p in range(len(prompts))]
        stats.prefill_positions_unshared = stats.prefill_positions
        stats.seconds = time.perf_counter() - t0
        return GenerationOutput(samples=samples, stats=stats)

    # ---- prefill and decode ------------------------------------------------------------------------------------

    def _prefill(
        self, prompts: list[tuple[int, ...]], cache: PrefixKV, stats: GenerationStats
    ) -> torch.Tensor:
        """Prefill every prompt once (packed, in groups of at most max_prefill_tokens); -> last-row logits."""
        out = []
        for group in prefill_groups(prompts, self.max_prefill_tokens):
            spans, segs, start = [], [], 0
            for p in group:
                n = len(prompts[p])
                spans.append((start, start + n))
                segs.append(QuerySegment(q_start=start, q_end=start + n, self_k_start=start))
                start += n
                stats.prompt_prefills[p] += 1
            s = -(-start // self._pad_to) * self._pad_to
            if s > start:  # padding: its own causal segment, invisible to every prompt
                segs.append(QuerySegment(q_start=start, q_end=s, self_k_start=start))
            layout = AttentionLayout(num_queries=s, num_keys=s, segments=tuple(segs))
            pad = [0] * (s - start)
            ids = torch.tensor([t for p in group for t in prompts[p]] + pad, dtype=torch.long)
            pos = torch.cat(
                [torch.arange(len(prompts[p])) for p in group] + [torch.zeros(len(pad), dtype=torch.long)]
            )
            # each prompt a root of the chunk's tree: a recurrent layer hands down its state at each prompt's end
            tree = ChunkTree(segments=tuple(ChunkSegment(a, b, None) for a, b in spans))
            ctx = LocalContext(layout=layout, capture=True, backend=self.backend, tree=tree)
            hidden, routes = self._forward(ids, pos, ctx)  # [s, h], [s, layers, k] | None
            cache.add_prompts(ctx.captured, spans)
            if routes is not None:
                for p, (a, b) in zip(group, spans, strict=True):
                    self._prompt_routes[p] = routes[a:b]
            out.append(self._logits(hidden[torch.tensor([b - 1 for _, b in spans])]))
            stats.prefill_forwards += 1
            stats.prefill_positions += start
        return torch.cat(out)

    def _decode(
        self, prompts: list[tuple[int, ...]], feed: list[Branch], cache: PrefixKV, stats: GenerationStats
    ) -> torch.Tensor:
        """One decode forward feeding each branch's newest token; -> logits [A, v] for its next token."""
        a = len(feed)
        longest = max(len(b.path) for b in feed)
        path = torch.zeros(a, longest, dtype=torch.long)
        for i, b in enumerate(feed):
            path[i, : len(b.path)] = torch.tensor(b.path)
        s = -(-a // self._pad_to) * self._pad_to
        step = DecodeStep(
            prompt_of=torch.tensor([b.prompt for b in feed]),
            slot=torch.tensor([b.path[-1] for b in feed]),
            path=path,
            path_len=torch.tensor([len(b.path) for b in feed]),
            state_rows=torch.tensor([b.state_row for b in feed]),
            padded_rows=s - a,
        )
        ids = torch.tensor([b.tokens[-1] for b in feed] + [0] * (s - a), dtype=torch.long)
        # the fed token is response token t-1 (0-based): its true position is P + t - 1
        pos = torch.tensor([len(prompts[b.prompt]) + len(b.tokens) - 1 for b in feed] + [0] * (s - a))
        ctx = DecodeContext(cache=cache, step=step.to(self.device), backend=self.backend)
        hidden, routes = self._forward(ids, pos, ctx)  # [s, h], [s, layers, k] | None
        if ctx.next_states:  # a hybrid: the state table is now one row per branch fed (forks share a row)
            cache.states = ctx.next_states
            for i, b in enumerate(feed):
                b.state_row = i
        if routes is not None:
            for i, b in enumerate(feed):  # row i fed branch b's newest token
                b.routes.append(routes[i])
        stats.decode_steps += 1
        stats.decode_positions += a
        return self._logits(hidden[:a])

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, ctx: BranchContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids/pos [s] -> final hidden states [s, h] (the whole sequence, also under sequence parallel), and with
        record_routing each row's experts [s, MoE layers, k] (megatron's routing, recorded)."""
        recorder = RoutingRecorder() if self.record_routing else None
        with (
            attach_context(self.model, ctx),
            attach_router_context(self.model, recorder),
            self.base.hidden_states_only(),
        ):
            hidden = self.model(ids.to(self.device)[None], pos.to(self.device)[None], None)  # [s(/tp), 1, h]
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        routes = None if recorder is None else recorder.experts(self.arch.moe_layers, self.arch.moe_top_k)
        return hidden[:, 0], routes

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, h] -> [m, v] logits over the real vocabulary, in the training logprob's precision (fp32, fp64)."""
        base = self.base
        w = (
            base.shared_embedding_or_output_weight()
            if base.share_embeddings_and_output_weights
            else (base.output_layer.weight)
        )  # [V/tp, h], the projection the training forward uses (schedule/common.py)
        acc = lse_dtype(hidden.dtype)
        x = hidden.to(acc) @ w.to(acc).t()  # [m, V/tp]
        if self.tp_size > 1:
            dev = comm_device(self.tp_group)
            m, v_local = x.shape
            parts = torch.empty(self.tp_size * m, v_local, dtype=x.dtype, device=dev)  # [tp*m, V/tp]
            dist.all_gather_into_tensor(parts, x.to(dev).contiguous(), group=self.tp_group)
            x = parts.view(self.tp_size, m, v_local).permute(1, 0, 2).reshape(m, -1).to(self.device)  # [m, V]
        return x[:, : self.vocab_size]

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _extend(
        self,
        branches: list[Branch],
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        stats: GenerationStats,
    ) -> None:
        """Draw the next token of each branch from its row of logits [len(branches), v]; a branch with
        observation tokens queued (multi-turn) takes the next of those instead."""
        drawn = [i for i, b in enumerate(branches) if not b.forced]
        forced = [i for i, b in enumerate(branches) if b.forced]
        if forced:  # the policy's logprob of each observation token, for the record (loss_mask 0)
            rows = logits[torch.tensor(forced)]
            toks = torch.tensor([branches[i].forced[0] for i in forced], device=rows.device)
            logp_f = torch.log_softmax(rows, dim=-1).gather(-1, toks[:, None]).squeeze(-1).tolist()
            for i, lp in zip(forced, logp_f, strict=True):
                multi_turn.append_forced(branches[i], lp, params.max_new_tokens)
            stats.observation_tokens += len(forced)
            logits = logits[torch.tensor(drawn, dtype=torch.long)]
        if not drawn:
            return
        sampled = [branches[i] for i in drawn]
        tokens, logp, logq = choose_tokens(logits, params, generator)
        if self.tp_size > 1:  # identical on every rank already; make it certain
            both = torch.stack([tokens.to(logp.dtype), logp, logq]).to(comm_device(self.tp_group))
            dist.broadcast(both, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            tokens, logp, logq = both[0].long(), both[1], both[2]
        stats.tokens_sampled += len(sampled)
        append_tokens(sampled, tokens.tolist(), logp.tolist(), logq.tolist(), params)
        if params.multi_turn is not None:
            multi_turn.end_turns(sampled, params.multi_turn, params.max_new_tokens)

    @property
    def _pad_to(self) -> int:
        return self.tp_size if self.sequence_parallel else 1

    def _check_prompts(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[tuple[int, ...]]:
        if not prompts:
            raise UserError("no prompts to generate from")
        out = []
        for i, prompt in enumerate(prompts):
            ids = validate_token_ids(prompt, name="prompt", where=f"prompt {i}", vocab_size=self.vocab_size)
            if not ids:
                raise UserError("prompt is empty", where=f"prompt {i}")
            if len(ids) + params.max_new_tokens > self.max_positions:
                raise UserError(
                    f"prompt length {len(ids)} + max_new_tokens {params.max_new_tokens} exceeds the model's "
                    f"{self.max_positions} positions",
                    where=f"prompt {i}",
                )
            out.append(ids)
        stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if stop:
            raise UserError(f"stop token ids {stop} are outside the vocabulary of {self.vocab_size}")
        return out
