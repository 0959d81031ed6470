"""What the benchmark runs: the variants (schedule + options), the model and the shapes, with named presets.

The variants, each on the SAME rollouts and the SAME model:
    naive-fused       each rollout alone, fused attention, logits only where a loss needs them: THE baseline
    packed-nosharing  all rollouts in one block-diagonal sequence, no sharing (verl's remove-padding packing)
    repeat-prefix     one pass, each branch attends to the prefix K/V repeated per branch (PrefixGrouper)
    naive             megatron-core's own unfused attention, every logit (the earlier baseline, for continuity)
    packed            the whole tree in one pass (shared prefix computed once)
    replay            depth-first replay with cached prefix K/V (bounded memory); small subtrees packed into chunks
                      of <= 4096 tokens (ScheduleOptions.chunk_tokens, on by default), as in every replay variant
    replay-nochunks   replay with chunk_tokens off: every segment its own forward (leaf micro-batches of 8)
    replay+recompute  replay keeping no graph for inner segments
    replay+recompute-full  and per-layer activation checkpointing inside every chunk (the planner's `full`)
    auto              packed when its planned activation peak fits the budget and the tree is at most one chunk of
                      replay's (4096 tokens), replay otherwise (plan/auto.py); the pick is made once per shape and
                      reported beside the row
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.data.random_trees import check_turn_tree
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch
from megatron_branch.precision import dtype_table

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "naive-fused": ("naive-fused", {}),
    "packed-nosharing": ("packed-nosharing", {}),
    "repeat-prefix": ("packed", {"backend": "repeat"}),
    "naive": ("naive", {}),
    "packed": ("packed", {}),
    "replay": ("replay", {}),
    "replay+recompute": ("replay", {"recompute": True}),
    "replay+recompute-full": ("replay", {"recompute": True, "recompute_layers": True}),
    # chunk_tokens off: one forward per segment (sibling leaves in micro-batches of branch_micro_batch), the replay
    # of issue 33's "replay, chunk_tokens off" column
    "replay-nochunks": ("replay", {"chunk_tokens": None}),
    "auto": ("auto", {}),  # resolved per shape to packed or replay (bench/runner.py make_case)
}
"""variant -> (schedule name, extra ScheduleOptions)."""

BASELINE = "naive-fused"
DTYPES = dtype_table()
"""--dtype: every dtype of precision.py's table."""


MODEL_FLAGS: dict[str, str] = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_query_groups",
    "ffn": "ffn_hidden_size",
    "vocab": "vocab_size",
    "tie": "tie_word_embeddings",
    "experts": "num_experts",
    "top_k": "moe_top_k",
    "expert_ffn": "moe_ffn_hidden_size",
}
"""The bench's short model flags (--layers, --kv-heads, ...) -> the ModelArch fields they set: the bench's model is
a ModelArch (models/arch.py; a Llama with random weights: only its shape matters for speed and memory)."""


def bench_model(
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 0,
    vocab: int = 1024,
    tie: bool = False,
    experts: int = 0,
    top_k: int = 2,
    expert_ffn: int = 0,
    full_attention_interval: int = 0,
) -> ModelArch:
    """The ModelArch the bench flags describe (ffn 0 = 3 x hidden); a bad flag is refused by its name.

    experts > 0: a Qwen3-MoE-style model (q/k norms, megatron's MoELayer in every MLP slot, top_k experts of width
    expert_ffn, 0 = hidden). `full_attention_interval` k > 0 makes a Qwen3.5-style hybrid (HF's name for it): every
    k-th layer gated full attention, the others gated delta net (k = 4: Qwen3.5's 3 linear : 1 full), with the
    family's q/k norms, output gate, zero-centred norms and partial RoPE (0.25), GDN value heads = --heads and key
    heads = half of them, every head --hidden / --heads wide, conv kernel 4. Both: a Qwen3.5-MoE-style hybrid."""
    for name, v in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                    ("vocab", vocab)):  # fmt: skip
        if v <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if heads % kv_heads:
        raise UserError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if hidden % heads:
        raise UserError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    if experts < 0 or (experts and not 0 < top_k <= experts):
        raise UserError(f"--experts {experts} / --top-k {top_k}: need 0 < top-k <= experts")
    if full_attention_interval < 0:
        raise UserError(f"--full-attention-interval must be >= 0, got {full_attention_interval}")
    if full_attention_interval > layers:
        raise UserError(
            f"--full-attention-interval {full_attention_interval} exceeds --layers {layers}: the model would have "
            "no full-attention layer (not a hybrid); use an interval <= --layers, or 0 for a dense model"
        )
    moe: dict[str, Any] = {}
    if experts:
        moe = dict(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=expert_ffn or hidden)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        ffn_hidden_size=ffn or 3 * hidden,
        tie_word_embeddings=tie,
    )
    if not full_attention_interval:
        if experts:
            return ModelArch(family="qwen3_moe", qk_norm=True, **moe, **common)
        return ModelArch(family="llama", **common)
    d = hidden // heads
    types = tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(layers)
    )
    try:  # the GDN head rule is the model's own (ModelArch): refused in one line, named by the flags
        return ModelArch(
            family="qwen3_5_moe" if experts else "qwen3_5", qk_norm=True, zero_centered_norm=True,
            attention_output_gate=True, rotary_percent=0.25, layer_types=types, linear_conv_kernel_dim=4,
            linear_key_head_dim=d, linear_value_head_dim=d, linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads, **moe, **common,
        )  # fmt: skip
    except ValueError as e:
        raise UserError(
            f"--heads {heads} with --full-attention-interval {full_attention_interval}: the gated delta net layers "
            f"take --heads value heads and --heads // 2 key heads ({e})"
        ) from None


def model_flags(arch: ModelArch) -> dict[str, Any]:
    """The bench flags of `arch` (bench_model's inverse; ffn 0 where it is the default 3 x hidden)."""
    flags = {flag: getattr(arch, name) for flag, name in MODEL_FLAGS.items()}
    if flags["ffn"] == 3 * flags["hidden"]:
        flags["ffn"] = 0  # follows --hidden when that is overridden
    if not flags["experts"]:
        flags["top_k"] = 2  # a dense model: --experts alone gives top-2
    if flags["expert_ffn"] == flags["hidden"]:
        flags["expert_ffn"] = 0
    types = arch.layer_types or ()
    flags["full_attention_interval"] = (types.index("full_attention") + 1) if arch.is_hybrid else 0
    assert bench_model(**flags) == arch, "not a bench model: its flags do not describe it"
    return flags


def with_context(arch: ModelArch, max_len: int) -> ModelArch:
    """`arch` with a RoPE table covering `max_len` positions (at least 4096)."""
    return dataclasses.replace(arch, max_position_embeddings=max(4096, max_len))


@dataclass(kw_only=True)
class BenchConfig:
    """One benchmark run: a model, a grid of tree shapes, the variants and how to time them."""

    model: ModelArch = field(default_factory=bench_model)
    """The model every variant runs (bench_model: the --layers/--hidden/... flags)."""
    prompts: tuple[int, ...] = (1024,)
    """Prompt lengths P (a sweep when several)."""
    branches: tuple[int, ...] = (8,)
    """Responses per prompt G (a sweep when several)."""
    response: int = 64
    """Tokens per response S (below the prompt, or per level with levels > 1)."""
    levels: int = 1
    """Levels of the response tree below the prompt (1 = G leaves right below it; more: shared response starts)."""
    groups: int = 1
    """Prompt groups in the tree (one step's batch): `groups` different prompts, each with its own G rollouts."""
    min_prompt: int = 0
    """With groups > 1: the prompts' lengths spread evenly from this to P (many small prompts of different
    lengths); 0 = every prompt P tokens."""
    memory_budget_gb: float | None = None
    """The `auto` variant's budget for packed's planned activation peak (GB); None: the device's free memory."""
    turns: int = 0
    """An agentic tree (data/random_trees.py agentic_tree_rollouts): policy turns of `response` tokens per rollout,
    each but the last followed by an observation (loss_mask 0); 0 = the single-turn shapes above."""
    observation: int = 0
    """Tokens of each observation (a tool's output) between turns."""
    branch_at_turns: tuple[int, ...] = ()
    """After these turns (and their observations) every trajectory forks in 2; G = the leaves."""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """Which variants to run; the baseline is always added."""
    rounds: int = 3
    """Timed rounds after one untimed warm-up round; each round runs every variant once, order rotated."""
    micro: int = 8
    """replay's branch_micro_batch."""
    dtype: str = "float32"
    """Parameter and activation dtype."""
    device: str = "cpu"
    """"cpu" or "cuda"."""
    meter: bool = True
    """Also run every variant once under the activation meter (deterministic saved-activation bytes)."""
    peak_tflops: float = 0.0
    """Peak FLOP/s of the device in TFLOP/s, for MFU (0 = do not report MFU)."""
    seed: int = 0
    """Seed of the model weights and the rollouts."""
    profile: str | None = None
    """Profile one extra step of this variant (first shape) with torch.profiler; its top ops go in the report."""

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise UserError(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
        if self.profile is not None and self.profile not in VARIANTS:
            raise UserError(f"--profile: unknown variant {self.profile!r}; valid: {', '.join(VARIANTS)}")
        if BASELINE not in self.variants:
            self.variants = (BASELINE, *self.variants)
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available")
        for name in ("rounds", "micro", "response", "levels"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name} must be positive, got {getattr(self, name)}")
        if not self.prompts or not self.branches or min(self.prompts) < 1 or min(self.branches) < 1:
            raise UserError("--prompt and --branches need positive values")
        self._check_turns()
        if self.levels > 1 and max(self.branches) > self.model.vocab_size:
            raise UserError(f"--branches {max(self.branches)} exceeds --vocab {self.model.vocab_size}")

    def _check_turns(self) -> None:
        check_turn_tree(turns=self.turns, observation=self.observation, branch_at_turns=self.branch_at_turns,
                        leaves=self.branches, leaves_flag="--branches")  # fmt: skip
        if self.turns and self.levels > 1:
            raise UserError("--levels and --turns both shape the response tree: use one or the other")
        if self.groups <= 0:
            raise UserError(f"--groups must be positive, got {self.groups}")
        if self.turns and self.groups > 1:
            raise UserError("--groups > 1 with --turns: the agentic tree has one prompt")
        if not 0 <= self.min_prompt <= min(self.prompts):
            raise UserError(
                f"--min-prompt must be between 0 and --prompt {min(self.prompts)}, got {self.min_prompt}"
            )
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise UserError(f"--memory-budget must be positive, got {self.memory_budget_gb}")

    @property
    def response_tokens(self) -> int:
        """Tokens of each rollout's response (turns and observations included)."""
        if not self.turns:
            return self.levels * self.response
        return self.turns * self.response + (self.turns - 1) * self.observation

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_m = bench_model


PRESETS: dict[str, dict[str, Any]] = {
    # the configurations (2-core CPU, float32)
    "A": dict(model=_m(layers=4, hidden=512, heads=8, kv_heads=2, vocab=32000), prompts=(4096,), branches=(8,),
              response=128),
    "B": dict(model=_m(layers=4, hidden=512, heads=8, kv_heads=2, vocab=32000), prompts=(1024,), branches=(16,),
              response=512),
    "C": dict(model=_m(layers=2, hidden=256, heads=4, kv_heads=2, vocab=32000), prompts=(8192,), branches=(16,),
              response=256),
    # replay's memory flat in G (configuration A's model and prompt, G = 4..32)
    "memory-G": dict(model=_m(layers=4, hidden=512, heads=8, kv_heads=2, vocab=32000), prompts=(4096,),
                     branches=(4, 8, 16, 32), response=128, variants=("naive-fused", "packed", "replay",
                                                                       "replay-nochunks", "replay+recompute")),
    # a mixture of experts (Qwen3-MoE-style: 8 experts of width 256, top-2, megatron's MoELayer) on the CPU
    "moe": dict(model=_m(layers=2, hidden=256, heads=4, kv_heads=2, vocab=32000, experts=8, top_k=2, expert_ffn=256),
                prompts=(2048,), branches=(8,), response=128,
                variants=("naive-fused", "packed-nosharing", "packed", "replay", "replay+recompute")),
    # a Qwen3.5-style hybrid (3 gated delta net : 1 gated attention layers) under a long prompt: GDN layers keep
    # their state at the fork instead of K/V (models/gdn.py); float32 on the 2-core CPU like A/B/C
    "hybrid": dict(model=_m(layers=4, hidden=512, heads=8, kv_heads=2, vocab=32000, full_attention_interval=4),
                   prompts=(4096,), branches=(8,), response=128,
                   variants=("naive-fused", "packed-nosharing", "packed", "replay")),
    # a tau^2-like agentic tree scaled down for the 2-core CPU: a 4K prompt (system prompt + tools), 6 policy turns
    # of 128 tokens with a 256-token tool output after each, forks after turns 2 and 4 (G = 8 leaves)
    "agentic": dict(model=_m(layers=2, hidden=256, heads=4, kv_heads=2, vocab=32000), prompts=(4096,),
                    branches=(8,), response=128, turns=6, observation=256, branch_at_turns=(2, 4),
                    variants=("naive-fused", "packed-nosharing", "packed", "replay")),
    # issue 33's tables (benchmarks/issue33_tables.sh): the demo's batch (examples/configs/demo.yaml: 16 prompts of
    # 57 tokens x 8 rollouts of 4 tokens, a 2-layer hidden-64 Llama) and many small prompts with shared response
    # beginnings (24 groups of 40-160 tokens x 8 rollouts, 2 levels of 32, a 4-layer hidden-256 Llama, vocabulary
    # 8000 as vs_hf.py's: a 32K head would be most of the step)
    "demo": dict(model=_m(layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=64), prompts=(57,), groups=16,
                 branches=(8,), response=4, variants=("naive-fused", "packed", "replay", "auto")),
    "small-prompts": dict(model=_m(layers=4, hidden=256, heads=4, kv_heads=2, vocab=8000), prompts=(160,),
                          min_prompt=40, groups=24, branches=(8,), response=32, levels=2,
                          variants=("naive-fused", "packed", "replay", "auto")),
    # seconds on a laptop: the smoke test and a first look
    "tiny": dict(model=_m(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64), prompts=(48,), branches=(4,),
                 response=8, rounds=1),
    # a 1B-class model (Llama-3.2-1B's shape) at P = 32K on one GPU, bf16
    "gpu-1b": dict(model=_m(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tie=True),
                   prompts=(32768,), branches=(8, 16), response=512, dtype="bfloat16", device="cuda",
                   variants=("naive-fused", "repeat-prefix", "packed", "replay", "replay+recompute"), micro=8),
}  # fmt: skip
"""name -> BenchConfig fields; command-line flags override them."""
