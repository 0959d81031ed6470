"""A plain megatron-core GRPO gradient step, the way an existing run computes it: every rollout is its own sequence.

patches/branch_replay.patch turns this file into a branch-replay step; tests/unit/test_patches.py applies the patch
and checks that both write the same gradients.

    python examples/plain_grpo_step.py --hf HF_DIR --rollouts rollouts.jsonl --out grads.safetensors
"""

from __future__ import annotations

import argparse
import warnings

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from safetensors.torch import save_file

from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.data import Rollout, read_rollouts_jsonl
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

warnings.filterwarnings("ignore")


def build_model(arch: ModelArch) -> GPTModel:
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=arch.to_transformer_config(dtype=torch.float32),
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )
    return model


def train_step(model: GPTModel, rollouts: list[Rollout], arch: ModelArch) -> float:
    """L = -(1/T) sum_i sum_{t in response_i} A_i logp(i, t): one sequence per rollout."""
    T = sum(len(r.response) for r in rollouts)
    total = 0.0
    for r in rollouts:
        seq = torch.tensor(r.prompt + r.response)
        n = seq.numel()
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]
        logits = model(seq[None], torch.arange(n)[None], mask)[0]  # [n, V]
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, seq[1:, None]).squeeze(1)
        loss = (
            -(r.advantage / T) * logp[max(len(r.prompt) - 1, 0) :].sum()
        )  # response tokens (an empty prompt:
        # the first token has no predictor)
        loss.backward()
        total += float(loss)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--rollouts", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    initialize_parallel(ParallelConfig())  # torch.distributed + megatron parallel_state (a world of one here)
    arch = ModelArch.from_hf_config(load_hf_config(args.hf))
    model = build_model(arch)
    reader = HFTensorReader(args.hf)
    state = hf_to_mcore_state(reader, arch, padded_vocab=arch.vocab_size)
    missing, _ = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing

    rollouts = read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size)
    loss = train_step(model, rollouts, arch)
    grads = {n: p.grad for n, p in model.named_parameters()}
    save_file({n: g.contiguous() for n, g in mcore_to_hf_state(grads, arch).items()}, args.out)
    print(f"loss {loss:.10f}")


if __name__ == "__main__":
    main()
