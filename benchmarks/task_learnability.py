"""How learnable is a built-in task for a tiny Llama-style model? Supervised warm-up, then greedy and sampled reward.

Runs the project's own pieces end to end on CPU: the sentencepiece tokenizer trained on the task's text, a
megatron-core GPTModel (build_model), supervised warm-up through `run_schedule` (the GRPO objective with advantage
1 is the token-mean NLL of the answers) with torch AdamW, and evaluation through `BranchSampler` on held-out
prompts: greedy exact-match and mean reward, and the reward of n sampled rollouts per prompt at temperature 1
(where RL starts) with the share of groups whose rewards differ (GRPO learns only from those).

    python benchmarks/task_learnability.py --task kv_retrieval --num-pairs 6 --hidden 64 --steps 300

Timings on a shared machine are indicative only; the step counts and accuracies are what to compare.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="kv_retrieval")
    ap.add_argument("--num-pairs", type=int, default=6, help="kv_retrieval haystack size")
    ap.add_argument("--key-len", type=int, default=2)
    ap.add_argument("--value-len", type=int, default=2)
    ap.add_argument("--value-chars", default="abcd")
    ap.add_argument("--length", type=int, default=24, help="copy_span filler length")
    ap.add_argument("--span-len", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval", type=int, default=64, help="held-out prompts")
    ap.add_argument("--n", type=int, default=8, help="sampled rollouts per held-out prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--rl-steps", type=int, default=0, help="on-policy GRPO steps after the warm-up")
    ap.add_argument("--rl-prompts", type=int, default=8)
    ap.add_argument("--rl-lr", type=float, default=1e-3)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument(
        "--warmup-until", type=float, default=None, help="stop the warm-up once greedy reward >= this"
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    from megatron_branch.data import PrefixTree
    from megatron_branch.generation import BranchSampler, SamplingParams
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions, run_schedule
    from megatron_branch.tasks import get_task, score_responses, warmup_rollouts
    from megatron_branch.tokenizer import SentencePieceTokenizer

    initialize_parallel(ParallelConfig(), seed=args.seed)
    if args.task == "kv_retrieval":
        opts = dict(
            num_pairs=args.num_pairs,
            key_len=args.key_len,
            value_len=args.value_len,
            value_chars=args.value_chars,
        )
    elif args.task == "copy_span":
        opts = dict(length=args.length, span_len=args.span_len, chars=args.value_chars)
    else:
        opts = dict(length=args.length, num_needles=args.span_len)
    task = get_task(args.task, **opts)
    t0 = time.perf_counter()
    tok = SentencePieceTokenizer.train_or_load(tempfile.mkdtemp(), task.corpus(300, seed=99))
    t_tok = time.perf_counter() - t0
    arch = ModelArch(family="llama", vocab_size=tok.vocab_size, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=args.heads, num_query_groups=args.heads, ffn_hidden_size=4 * args.hidden,
                     max_position_embeddings=512)  # fmt: skip
    model = build_model(arch, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sopts = ScheduleOptions(vocab_size=arch.vocab_size)
    sampler = BranchSampler(model, vocab_size=arch.vocab_size)
    held_out = task.rows(args.eval, seed=10_000 + args.seed)
    prompts = [tok.encode(r.prompt) for r in held_out]

    def evaluate() -> dict:
        out = sampler.generate(
            prompts, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(tok.eos_id,))
        )
        texts = [tok.decode(s.response) for s in out.flat()]
        greedy = score_responses(task.reward, held_out, texts)
        exact = sum(t.strip() == r.fields["answer"] for t, r in zip(texts, held_out)) / len(held_out)
        sp = SamplingParams(n=args.n, max_new_tokens=8, temperature=1.0, stop_token_ids=(tok.eos_id,))
        gen = torch.Generator().manual_seed(args.seed)
        out = sampler.generate(prompts, sp, generator=gen)
        rows = [r for r in held_out for _ in range(args.n)]
        sampled = score_responses(task.reward, rows, [tok.decode(s.response) for s in out.flat()])
        groups = [sampled[i : i + args.n] for i in range(0, len(sampled), args.n)]
        varied = sum(max(g) > min(g) for g in groups) / len(groups)
        return dict(greedy_reward=sum(greedy) / len(greedy), greedy_exact=exact,
                    sampled_reward=sum(sampled) / len(sampled), groups_with_signal=varied,
                    gen_tokens_per_s=round(out.stats.tokens_per_s, 1))  # fmt: skip

    prompt_len = sum(len(p) for p in prompts) / len(prompts)
    print(json.dumps(dict(task=task.name, options=opts, vocab=tok.vocab_size, prompt_tokens=prompt_len,
                          tokenizer_s=round(t_tok, 2), params=sum(p.numel() for p in model.parameters()))))  # fmt: skip
    print(json.dumps(dict(step=0, **evaluate())))
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = warmup_rollouts(task, tok, args.batch, seed=args.seed * 1_000_003 + step)
        tree = PrefixTree.build(batch, vocab_size=arch.vocab_size)
        obj = PolicyGradientObjective.grpo([1.0] * len(batch), tree.num_response_tokens_logical())
        optim.zero_grad(set_to_none=True)
        res = run_schedule("packed", model, tree, obj, sopts)
        optim.step()
        if step % args.eval_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t_train
            metrics = evaluate()
            print(json.dumps(dict(step=step, nll=round(res.loss, 4), train_s=round(elapsed, 1), **metrics)))
            if args.warmup_until is not None and metrics["greedy_reward"] >= args.warmup_until:
                break

    # on-policy GRPO (one update per batch): group-normalised advantages, the policy-gradient objective
    for group in optim.param_groups:
        group["lr"] = args.rl_lr
    sp = SamplingParams(n=args.n, max_new_tokens=args.max_new, temperature=1.0, stop_token_ids=(tok.eos_id,))
    gen = torch.Generator().manual_seed(args.seed + 1)
    rewards_log: list[float] = []
    t_rl = time.perf_counter()
    for step in range(1, args.rl_steps + 1):
        rows = task.rows(args.rl_prompts, seed=20_000 + step)
        out = sampler.generate([tok.encode(r.prompt) for r in rows], sp, generator=gen)
        flat_rows = [r for r in rows for _ in range(args.n)]
        rewards = score_responses(task.reward, flat_rows, [tok.decode(s.response) for s in out.flat()])
        adv: list[float] = []
        for i in range(0, len(rewards), args.n):
            g = torch.tensor(rewards[i : i + args.n], dtype=torch.float64)
            adv += ((g - g.mean()) / (g.std() + 1e-6)).tolist() if g.max() > g.min() else [0.0] * args.n
        rollouts = [s.to_rollout(advantage=a) for s, a in zip(out.flat(), adv)]
        tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
        obj = PolicyGradientObjective.grpo(adv, tree.num_response_tokens_logical())
        optim.zero_grad(set_to_none=True)
        run_schedule("replay", model, tree, obj, sopts)
        optim.step()
        rewards_log.append(sum(rewards) / len(rewards))
        resp_len = out.stats.response_tokens / out.stats.num_samples
        if step % 10 == 0 or step == args.rl_steps:
            first, last = rewards_log[:10], rewards_log[-10:]
            print(json.dumps(dict(rl_step=step, reward_mean=round(rewards_log[-1], 4),
                                  first10=round(sum(first) / len(first), 4), last10=round(sum(last) / len(last), 4),
                                  positions=f"{tree.positions_computed}/{tree.positions_logical}", resp_len=round(resp_len, 2),
                                  rl_s=round(time.perf_counter() - t_rl, 1))))  # fmt: skip
    if args.rl_steps:
        print(json.dumps(dict(final=True, **evaluate())))


if __name__ == "__main__":
    main()
