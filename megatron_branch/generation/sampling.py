"""Choosing the next token from logits: temperature, top-k, top-p, greedy; and the logprobs recorded for it.

Shape legend: m rows (one per branch being extended), v real vocabulary.

Two logprobs are recorded per sampled token (see types.Sample):
    policy    log_softmax(logits)[token]: the policy at temperature 1, which is what the training forward
              computes for the token and what PPO's ratio exp(logp - old) needs as `old`;
    sampling  log q(token), q the filtered, temperature-scaled distribution the token was drawn from (0 for greedy).
The filter order is Hugging Face's: temperature, then top-k, then top-p (the smallest set of most likely tokens
whose mass reaches top_p; the most likely token is always kept).
"""

from __future__ import annotations

import torch

from megatron_branch.generation.types import SamplingParams


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[m, v] policy logits -> [m, v] logits of the sampling distribution (filtered tokens at -inf)."""
    x = logits / params.temperature if params.temperature not in (0.0, 1.0) else logits.clone()
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [m, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [m, v]
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p  # [m, v]; the first token has before = 0 and is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [m, v] (real vocabulary, float32/64)
    -> (tokens [m] long, policy logprobs [m], sampling logprobs [m])."""
    logp = torch.log_softmax(logits, dim=-1)  # [m, v] the policy at temperature 1
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)  # first maximum: ties go to the lowest id
        logq = torch.zeros(tokens.shape, dtype=logits.dtype, device=logits.device)
    else:
        q_logits = sampling_logits(logits, params)
        q = torch.softmax(q_logits, dim=-1)  # [m, v]
        tokens = torch.multinomial(q, 1, generator=generator).squeeze(-1)  # [m]
        logq = torch.log_softmax(q_logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), logq
