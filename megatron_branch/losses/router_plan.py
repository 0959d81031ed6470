"""MoE router losses and routing under sharing, one schedule call's part (`RouterPlan`): multiplicity-weighted
load-balancing and z losses, routing replay, routing counts (docs/design.md "Mixture of experts: exact under
sharing"; the per-forward routing: losses/routing.py; the settings: losses/router.py).

Shape legend: n rows of one router call on this rank (s/tp under sequence parallel), E routed experts, k top-k,
G groups of tokens (prefix-tree segments for packed/replay, rollouts for naive and the unshared baselines), R
rollouts, N packed tree tokens, Lm MoE layers.

The reference (what naive training computes) for one micro-batch of R rollouts, T = sum_r T_r tokens (prompt and
response: every position the model runs, as megatron counts them), per MoE layer, s_x the router's softmax scores
of token x and m_x its top-k map over all E experts (megatron's `compute_routing_scores_for_aux_loss`):

    aux_loss         c E / (k T^2) * sum_e (sum_x s_xe) (sum_x m_xe)                 megatron's aux_loss
    seq_aux_loss     (c / R) sum_r E / (k T_r^2) * sum_e (sum_{x in r} s_xe)(sum_{x in r} m_xe)   one sequence = one rollout
    global_aux_loss  c E / (k T_g^2) * sum_e (sum_x s_xe) * Mbar_e                   megatron's running average:
                     Mbar = mean over this update's micro-batches so far of the counts summed over DP, T_g the
                     tokens of this micro-batch summed over DP
    z_loss           c / T * sum_x logsumexp(logits_x)^2

where x runs over the LOGICAL tokens (a token shared by m rollouts is m tokens). Each is a product of token sums
with counts that are constants (no gradient flows through a top-k map), so with the counts known its gradient is a
per-token sum: a tree that computes a shared token once weights its row by its multiplicity (the rollouts through
its segment; `token_multiplicity`), and its seq-aux row by the sum over those rollouts of their own coefficients.
The counts need every token's routing before the first backward, so the tree schedules first run the same
schedule forward-only to count (`RouterPlan.counting`); the training forward checks that it routes the same.

Routing replay (verl's router_replay, slime's --use-routing-replay, R3): rows whose token carries recorded experts
(Rollout.routed_experts) take those top-k; their probabilities come from the current router's scores at the
recorded experts (megatron's RouterReplay REPLAY_FORWARD: `scores.gather(1, recorded)`), so gradients flow as in
megatron. The aux maps m_x stay megatron's fresh top-k.

Every loss is attached where megatron attaches it (`MoEAuxLossAutoScaler`: the z-loss on the logits, the balancing
losses on the probabilities) and multiplied by `loss_scale` (megatron: 1/number of micro-batches, the DP mean
being our sum over DP of 1/(micro-batches of all ranks)).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_branch.errors import UserError
from megatron_branch.losses.router import LOSS_NAMES, MoEOptions
from megatron_branch.losses.routing import RowContext

if TYPE_CHECKING:
    from megatron_branch.data import PrefixTree


def token_multiplicity(member: torch.Tensor) -> torch.Tensor:
    """[G] how many rollouts contain each group's tokens (membership [G, R] row sums): the weight of its rows."""
    return member.sum(dim=1)


class RouterPlan:
    """The router work of one schedule call over `tree`: which groups the rows belong to, the groups' membership in
    rollouts, the counts (from the counting pass), forced routes, and the metrics of the call.

    `by_rollout`: groups are rollouts (the naive schedule and the unshared baselines run each rollout's tokens as
    its own rows); else prefix-tree segments (packed, replay). `pp_group`: the pipeline group when the model is cut
    into stages (schedule/pipeline.py): each stage routes, counts and weighs only its own MoE layers (the counts a
    layer's losses multiply are that layer's), and the call's metrics are gathered over the stages at the end, as
    megatron's tracker reduces its per-layer values over the pipeline group (moe_utils.reduce_aux_losses_tracker_
    across_ranks)."""

    def __init__(
        self,
        tree: PrefixTree,
        opts: MoEOptions,
        *,
        by_rollout: bool,
        moe_layers: Sequence[int],
        top_k: int,
        num_experts: int,
        pp_group: Any = None,
    ) -> None:
        self.tree, self.opts, self.cfg = tree, opts, opts.losses
        self.pp_group = pp_group
        self.by_rollout = by_rollout
        self.moe_layers = tuple(moe_layers)  # 0-based model layers, in order
        self.top_k, self.num_experts = top_k, num_experts
        R = len(tree.rollouts)
        if by_rollout:
            self.member = torch.eye(R, dtype=torch.float64)  # [G=R, R]
            self.group_len = torch.tensor([len(r.sequence) for r in tree.rollouts], dtype=torch.float64)
        else:
            self.member = torch.zeros(len(tree.segments), R, dtype=torch.float64)  # [G=S, R]
            for r in range(R):
                self.member[list(tree.rollout_segments(r)), r] = 1.0
            self.group_len = torch.tensor([s.length for s in tree.segments], dtype=torch.float64)
        self.weight = token_multiplicity(self.member)  # [G]
        self.T_r = self.member.t() @ self.group_len  # [R] tokens of each rollout
        self.T = float(self.T_r.sum())  # logical tokens of the micro-batch
        self.batch_rows = self._batch_rows(opts.micro_batches, R)  # [G, nb] or None
        # [G] each group's z-loss row weight: c / T per logical token, or sum over micro-batches of w_gb / T_b
        self.z_rows = (
            self.weight / self.T
            if self.batch_rows is None
            else self.batch_rows @ (1.0 / (self._batch_member(opts.micro_batches, R) @ self.T_r))
        )
        self.routes = _tree_routes(tree, len(self.moe_layers), top_k) if opts.routing_replay else None
        self.counting = False
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [G, E] top-k (aux) map counts per group
        self.seen: dict[int, torch.Tensor] = {}  # the same, counted by the training forward (checked)
        self.derived: dict[int, dict[str, Any]] = {}
        self.tp_cp_group: Any = None
        self.stats: dict[str, torch.Tensor] = {}  # metric -> detached value (on the model's device)
        self.tokens: dict[int, torch.Tensor] = {}  # layer -> [2, E] routed rows: computed, logical (weighted)

    def _batch_member(self, batches: Sequence[Sequence[int]] | None, R: int) -> torch.Tensor:
        """[nb, R] 1 where rollout r is in micro-batch b (MoEOptions.micro_batches: a partition of the rollouts)."""
        assert batches is not None
        out = torch.zeros(len(batches), R, dtype=torch.float64)
        for b, rows in enumerate(batches):
            out[b, list(rows)] = 1.0
        assert torch.equal(out.sum(dim=0), torch.ones(R, dtype=torch.float64)), "micro_batches: a partition"
        return out

    def _batch_rows(self, batches: Sequence[Sequence[int]] | None, R: int) -> torch.Tensor | None:
        """[G, nb] how many of micro-batch b's rollouts contain group g's tokens (its rows' weight there)."""
        if batches is None:
            return None
        return self.member @ self._batch_member(batches, R).t()

    @property
    def needs_counts(self) -> bool:
        return self.cfg.balancing

    # ---- contexts ---------------------------------------------------------------------------------------------
    def chunk_context(self, token_index: torch.Tensor) -> RowContext:
        """A tree chunk's rows: packed tree index per row (-1 = padding), padded to the forward's rows."""
        assert not self.by_rollout
        packed = token_index.to(torch.long)
        groups = torch.where(
            packed >= 0, self.tree.segment_ids[packed.clamp(min=0)], torch.full_like(packed, -1)
        )
        return RowContext(self, packed, groups)

    def rollouts_context(self, rollouts: Sequence[int], rows: int) -> RowContext:
        """Rollouts laid end to end (each its own group), padded to `rows`."""
        assert self.by_rollout
        packed = [self.tree.rollout_indices(i) for i in rollouts]
        groups = [torch.full((len(p),), i, dtype=torch.long) for i, p in zip(rollouts, packed, strict=True)]
        n = sum(len(p) for p in packed)
        pad = torch.full((rows - n,), -1, dtype=torch.long)
        return RowContext(self, torch.cat([*packed, pad]), torch.cat([*groups, pad]))

    # ---- counting ---------------------------------------------------------------------------------------------
    @contextmanager
    def counting_pass(self) -> Iterator[None]:
        """Within: router calls count their top-k maps per group (the schedule runs forward-only)."""
        self.counting = True
        try:
            yield
        finally:
            self.counting = False
        self.counts = self._reduced(self.counts)
        self._derive()

    def _reduced(self, table: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Counts summed over the router's TP x CP group (each rank counted its own rows)."""
        g = self.tp_cp_group
        if g is None or not dist.is_initialized() or dist.get_world_size(g) == 1:
            return {layer: t.cpu() for layer, t in table.items()}
        from megatron_branch.parallel.groups import comm_device

        dev = comm_device(g)
        out = {}
        for layer in sorted(table):  # the same order on every rank (every rank ran the same layers)
            t = table[layer].to(device=dev, dtype=torch.float64)
            dist.all_reduce(t, group=g)
            out[layer] = t.cpu()
        return out

    def _derive(self) -> None:
        """Per layer: the counts the losses multiply (M over the micro-batch, M_r per rollout, the seq-aux row
        coefficients per group, global_aux's running average), from the per-group counts."""
        E, k, R = self.num_experts, self.top_k, len(self.tree.rollouts)
        cfg = self.cfg
        glob = self.opts.global_state
        T_g = (
            self._dp_sum(torch.tensor([self.T], dtype=torch.float64))[0].item()
            if cfg.global_aux_loss_coeff
            else 0
        )
        for layer, c in self.counts.items():  # c [G, E]
            M_r = self.member.t() @ c  # [R, E] per-rollout counts
            d: dict[str, Any] = {"M": M_r.sum(dim=0)}  # [E] micro-batch counts (logical tokens)
            if self.batch_rows is not None:  # several micro-batches: each one's aux (and seq-aux: bsz 1)
                Bm = self._batch_member(self.opts.micro_batches, R)  # [nb, R]
                M_b, T_b = Bm @ M_r, Bm @ self.T_r  # [nb, E], [nb]
                for name, coeff in (("aux", cfg.aux_loss_coeff), ("seq", cfg.seq_aux_loss_coeff)):
                    if coeff:
                        a = coeff * E / (k * T_b**2)  # [nb]
                        d[name] = self.batch_rows @ (a[:, None] * M_b)  # [G, E] row coefficients
                self.derived[layer] = d
                continue
            if cfg.seq_aux_loss_coeff:
                a = cfg.seq_aux_loss_coeff * E / (R * k * self.T_r**2)  # [R]
                d["seq"] = self.member @ (a[:, None] * M_r)  # [G, E] row coefficients
            if cfg.global_aux_loss_coeff:
                M_g = self._dp_sum(d["M"])
                if glob is not None:
                    glob.sums[layer] = glob.sums.get(layer, torch.zeros_like(M_g)) + M_g
                    d["Mbar"] = glob.sums[layer] / (glob.steps + 1)
                else:
                    d["Mbar"] = M_g
                d["T_g"] = T_g
            self.derived[layer] = d
        if cfg.global_aux_loss_coeff and glob is not None:
            glob.steps += 1

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        g = self.opts.dp_group
        if g is None or not dist.is_initialized() or dist.get_world_size(g) == 1:
            return t
        from megatron_branch.parallel.groups import comm_device

        t = t.to(comm_device(g))
        dist.all_reduce(t, group=g)
        return t.cpu()

    # ---- the losses ------------------------------------------------------------------------------------------
    def balancing_loss(
        self, layer: int, scores: torch.Tensor, groups: torch.Tensor, w: torch.Tensor, *, record: bool = True
    ) -> torch.Tensor:
        """This call's share of the layer's load-balancing losses: scores [n, E], groups [n] (-1 = padding), w [n]
        row weights (multiplicity; 0 = padding). `record`: add it to the metrics (not in a recomputation)."""
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

        d, cfg = self.derived[layer], self.cfg
        E, k = self.num_experts, self.top_k
        weighted = scores * w.to(scores)[:, None]  # [n, E]: a shared row counts once per rollout
        loss = scores.new_zeros(())
        parts: dict[str, torch.Tensor] = {}
        if cfg.aux_loss_coeff and "aux" in d:  # per micro-batch (MoEOptions.micro_batches)
            coef = torch.cat([d["aux"], d["aux"].new_zeros(1, E)])[groups]  # row -1 -> zeros
            parts["aux_loss"] = (scores * coef.to(scores)).sum()
        elif cfg.aux_loss_coeff:
            parts["aux_loss"] = switch_load_balancing_loss_func(
                weighted, d["M"].to(scores), self.T, k, E, cfg.aux_loss_coeff
            )
        if cfg.seq_aux_loss_coeff:
            coef = torch.cat([d["seq"], d["seq"].new_zeros(1, E)])[groups]  # row -1 -> zeros
            parts["seq_aux_loss"] = (scores * coef.to(scores)).sum()
        if cfg.global_aux_loss_coeff:
            parts["global_aux_loss"] = switch_load_balancing_loss_func(
                weighted, d["Mbar"].to(scores), d["T_g"], k, E, cfg.global_aux_loss_coeff
            )
        for name, value in parts.items():
            loss = loss + value
            if record:
                self._add_loss_stat(name, layer, value)
        return loss * self.opts.loss_scale

    def z_loss(
        self, layer: int, logits: torch.Tensor, groups: torch.Tensor, *, record: bool = True
    ) -> torch.Tensor:
        """This call's share of the layer's z-loss: c sum_x z_x logsumexp(logits_x)^2, z_x = w_x / T (or, over
        several micro-batches, the sum of w_xb / T_b); groups [n] (-1 = padding)."""
        zw = torch.cat([self.z_rows, self.z_rows.new_zeros(1)]).to(logits.device)[groups]  # row -1 -> 0
        z = (torch.logsumexp(logits, dim=-1).square() * zw.to(logits)).sum() * self.cfg.z_loss_coeff
        if record:
            self._add_loss_stat("z_loss", layer, z)
        return z * self.opts.loss_scale

    def _add_loss_stat(self, name: str, layer: int, value: torch.Tensor) -> None:
        """megatron's tracker value: the loss over its coefficient; kept times loss_scale so that it adds over
        micro-batches and ranks to the mean over micro-batches (megatron's track_moe_metrics)."""
        key = f"moe/{LOSS_NAMES[name]}_layer_{layer}"
        v = value.detach().to(torch.float64) * (self.opts.loss_scale / self.cfg.coeffs()[name])
        self.stats[key] = self.stats[key] + v if key in self.stats else v

    # ---- the end of the call ---------------------------------------------------------------------------------
    def finish(self) -> dict[str, float]:
        """After the training (or scoring) call: check the training forward routed as the counting pass did, and
        return the call's metrics (summed over TP x CP: add them over micro-batches and DP)."""
        if self.needs_counts and self.seen:
            seen = self._reduced(self.seen)
            for layer, c in self.counts.items():
                if not torch.equal(seen.get(layer, torch.zeros_like(c)), c):
                    raise RuntimeError(
                        f"layer {layer}: the training forward routed differently from the counting pass (a "
                        "non-deterministic forward): the load-balancing counts would not be the batch's"
                    )
        out: dict[str, float] = {}
        stats: dict[str, float] = {}
        loss_keys = [f"moe/{LOSS_NAMES[n]}_layer_{i}" for n in self.cfg.coeffs() for i in self.moe_layers]
        self.stats = self._over_stages(self.stats, loss_keys, ())
        self.tokens = self._over_stages(self.tokens, list(self.moe_layers), (2, self.num_experts))
        if self.stats:
            names = sorted(self.stats)
            t = self._reduced_vector(torch.stack([self.stats[n].cpu() for n in names]))
            stats = dict(zip(names, t.tolist(), strict=True))
        out.update(stats)
        for name in {LOSS_NAMES[n] for n in self.cfg.coeffs()}:  # megatron's headline: mean over MoE layers
            out[name] = sum(stats.get(f"moe/{name}_layer_{i}", 0.0) for i in self.moe_layers) / len(
                self.moe_layers
            )
        for layer in sorted(self.tokens):
            t = self._reduced_vector(self.tokens[layer].cpu())
            for e in range(self.num_experts):
                out[f"moe/tokens_per_expert/computed/layer_{layer}/expert_{e}"] = float(t[0, e])
                out[f"moe/tokens_per_expert/logical/layer_{layer}/expert_{e}"] = float(t[1, e])
        return out

    def _over_stages(self, table: dict[Any, torch.Tensor], keys: list[Any], shape: tuple[int, ...]) -> dict:
        """`table` (this stage's layers' entries, each of `shape`) joined with every other stage's: one sum over the
        pipeline group of [len(keys), numel + 1] (the last column: the entry exists), the stages' layers being
        disjoint; the keys some stage holds come back. Without a pipeline group: `table`."""
        g = self.pp_group
        if g is None or not dist.is_initialized() or dist.get_world_size(g) == 1:
            return table
        from megatron_branch.parallel.groups import comm_device

        assert set(table) <= set(keys), (sorted(table), keys)
        numel = int(torch.Size(shape).numel())
        flat = torch.zeros(len(keys), numel + 1, dtype=torch.float64)
        for i, k in enumerate(keys):
            if k in table:
                flat[i, :numel] = table[k].detach().cpu().to(torch.float64).reshape(-1)
                flat[i, numel] = 1.0
        flat = flat.to(comm_device(g))
        dist.all_reduce(flat, group=g)
        flat = flat.cpu()
        return {k: flat[i, :numel].reshape(shape) for i, k in enumerate(keys) if flat[i, numel] > 0}

    def _reduced_vector(self, t: torch.Tensor) -> torch.Tensor:
        g = self.tp_cp_group
        if g is None or not dist.is_initialized() or dist.get_world_size(g) == 1:
            return t
        from megatron_branch.parallel.groups import comm_device

        t = t.to(comm_device(g))
        dist.all_reduce(t, group=g)
        return t.cpu()


def _tree_routes(tree: PrefixTree, num_layers: int, top_k: int) -> torch.Tensor:
    """[N, Lm, k] long: each packed token's recorded experts (-1: none). A prefix tree built from rollouts with
    records shares a position only where the records agree (PrefixTree keys tokens by them)."""
    routes = torch.full((tree.num_tokens, num_layers, top_k), -1, dtype=torch.long)
    for i, r in enumerate(tree.rollouts):
        rec = r.routed_experts
        if rec is None:
            raise UserError(
                "routing replay is on but the rollout has no routed_experts (record them when sampling)",
                where=r.describe(i),
            )
        if tuple(rec.shape[1:]) != (num_layers, top_k):
            raise UserError(
                f"routed_experts has shape {list(rec.shape)}; the model routes {num_layers} MoE layers x top-{top_k}",
                where=r.describe(i),
            )
        routes[tree.rollout_indices(i)] = rec.to(torch.long)
    return routes
