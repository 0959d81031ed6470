"""The parallel layout: how many ranks each axis has (torchtitan's ParallelDims), validated once, in one place.

SHAPE LEGEND (ranks): world = pp * dp * cp * tp. TP splits heads and MLP columns (and, with sequence parallel, the
activations between them), CP splits every chunk's tokens (ring attention), DP splits the batch by whole prompt
groups, PP splits the layers into consecutive pipeline stages (megatron's pipeline_model_parallel_size; the tree
schedules under it: schedule/pipeline.py). EP (expert parallel, a MoE model's experts) is carved out of dp * cp as
in megatron and torchtitan: it does not multiply the world, it must divide dp * cp (megatron's
expert_model_parallel_size). The experts' own tensor split, ETP (megatron's expert_tensor_parallel_size), is TP by
default or 1: every expert whole on each TP rank (megatron allows expert biases, gpt-oss's, only there), its
gradient then summed over megatron's expert-data-parallel group, which spans the TP ranks (models/expert_tp.py).

    layout = ParallelLayout(tp=2, cp=2, sequence_parallel=True)    # dp None: the rest of the world
    layout.data_parallel_size(8)                                   # 2; a world that does not divide is refused

One type for every part that describes ranks: the process groups (parallel/groups.py builds them from it), the
train config's `parallel` section (this class), the planner (plan.model.Layout adds its recompute mode) and the
long-context rehearsal (bench/rehearsal.py). Every refusal is a SettingError: `--tp` on the command line,
`parallel.tp` in a config (errors.Spelling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_branch.errors import SettingError

SIZES = ("tp", "cp", "dp", "pp", "ep", "etp")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How the ranks are laid out (world = pp * dp * cp * tp)."""

    tp: int = 1
    """Tensor-parallel size: heads and MLP columns are split over it (must divide the heads)."""
    cp: int = 1
    """Context-parallel size: every chunk's tokens are split over it, attention runs as a ring (packed or replay;
    naive is refused)."""
    dp: int | None = None
    """Data-parallel size: whole prompt groups per rank; None = the rest of the world (world / (tp * cp))."""
    pp: int = 1
    """Pipeline-parallel stages: the layers split into pp consecutive stages (must divide the layers), the tree's
    chunks flowing through them (schedule/pipeline.py; replay and packed)."""
    ep: int = 1
    """Expert-parallel size of a MoE model: its experts are split over ep ranks laid inside dp * cp as megatron
    lays them (expert_model_parallel_size; world = tp * cp * dp, ep must divide cp * dp)."""
    etp: int | None = None
    """Expert tensor-parallel size of a MoE model (megatron's expert_tensor_parallel_size): None = tp (each expert
    split over the TP group), or 1 (each expert whole on every TP rank, sequence parallel at tp > 1; grad, convert
    and train run it)."""
    sequence_parallel: bool = False
    """Shard the activations outside attention/MLP along the sequence over the TP group (needs tp > 1)."""

    def __post_init__(self) -> None:
        for name in SIZES:
            v = getattr(self, name)
            if v is None and name in ("dp", "etp"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SettingError(
                    lambda s, n=name, v=v: f"{s.name(n)} must be a positive integer, got {v!r}"
                )
        if self.etp not in (None, 1, self.tp):
            raise SettingError(
                lambda s: (
                    f"{s.value('etp', self.etp)} must be 1 or {s.name('tp')} ({self.tp}): the engine splits experts "
                    "over the whole TP group or not at all"
                )
            )
        if self.dp is not None:
            self._check_ep(self.dp)

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (megatron's expert_tensor_parallel_size): etp, or tp when unset."""
        return self.tp if self.etp is None else self.etp

    @property
    def ep_spans_dp(self) -> bool:
        """Some EP group holds ranks of different data-parallel replicas: megatron lays the expert groups
        (etp x ep x edp, etp fastest) over a stage's tp x cp x dp ranks (tp fastest), so an EP group stays inside
        one replica's tp x cp ranks exactly when ep * etp divides tp * cp (parallel/groups.py measures the same
        on the built groups)."""
        return self.ep > 1 and (self.tp * self.cp) % (self.ep * self.expert_tp) != 0

    @property
    def sp(self) -> bool:
        """Sequence parallel in effect (it needs a TP group to shard over)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (megatron's expert data-parallel group: tp / etp * cp * dp / ep)."""
        assert self.dp is not None, "the data-parallel size is not resolved yet (for_world)"
        return self.tp // self.expert_tp * self.cp * self.dp // self.ep

    @property
    def model_parallel(self) -> int:
        """Ranks of one model replica (tp * cp * pp)."""
        return self.tp * self.cp * self.pp

    @property
    def world(self) -> int:
        """pp * dp * cp * tp (dp must be known: given, or resolved by `for_world`)."""
        assert self.dp is not None, "the data-parallel size is not resolved yet (for_world)"
        return self.model_parallel * self.dp

    def data_parallel_size(self, world_size: int) -> int:
        """dp for `world_size` ranks; a world that is not a multiple of tp*cp*pp, or contradicts a given dp, is
        refused."""
        mp = self.model_parallel
        if mp > world_size:  # "16 > 8" said outright, not "8 is not a multiple of 16"
            raise SettingError(
                lambda s: f"{self._axes()} = {self._sizes()} = {mp} ranks > world size {world_size}"
            )
        if world_size % mp:
            raise SettingError(
                lambda s: (
                    f"world size {world_size} is not a multiple of {self._axes()} = {self._sizes()} = {mp}"
                )
            )
        dp = world_size // mp
        self._check_ep(dp)
        if self.dp is not None and self.dp != dp:
            raise SettingError(
                lambda s: (
                    f"{s.value('dp', self.dp)} does not match the world: {world_size} ranks / "
                    f"({self._axes()} = {mp}) = {dp}"
                )
            )
        return dp

    def _axes(self) -> str:
        """The model-parallel axes a world must divide by: `tp*cp` (and `*pp` when pipelined)."""
        return "tp*cp" if self.pp == 1 else "tp*cp*pp"

    def _sizes(self) -> str:
        return f"{self.tp}*{self.cp}" if self.pp == 1 else f"{self.tp}*{self.cp}*{self.pp}"

    def _check_ep(self, dp: int) -> None:
        """megatron lays the expert-parallel group inside the data- and context-parallel ranks."""
        if (dp * self.cp) % self.ep:
            raise SettingError(
                lambda s: (
                    f"{s.value('ep', self.ep)} must divide cp*dp = {self.cp}*{dp} = {self.cp * dp} (megatron lays "
                    "the expert-parallel group inside the data- and context-parallel ranks)"
                )
            )

    def for_world(self, world_size: int) -> ParallelLayout:
        """This layout with dp resolved for `world_size` ranks."""
        return dataclasses.replace(self, dp=self.data_parallel_size(world_size))

    def check_no_op(self) -> None:
        """Refuse a setting that would do nothing (a silent no-op hides a mistake)."""
        if self.sequence_parallel and self.tp == 1:
            raise SettingError(
                lambda s: (
                    f"{s.name('sequence_parallel')} does nothing at {s.value('tp', 1)} (it splits "
                    "activations over the TP group)"
                )
            )

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)
