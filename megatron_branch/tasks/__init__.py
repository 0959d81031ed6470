"""Prompt data and rewards: a JSONL prompt reader, rewards loaded from `module:function`, and built-in verifiable
synthetic long-prompt tasks (key-value retrieval, copy a marked span) with seeded generators."""

from megatron_branch.tasks.dataset import PromptRow, read_prompts_jsonl, write_prompts_jsonl
from megatron_branch.tasks.evaluate import EvalResult, evaluate
from megatron_branch.tasks.reward import RewardFn, load_reward, score_responses
from megatron_branch.tasks.synthetic import (
    TASKS,
    CopySpanTask,
    KeyValueTask,
    NeedleTask,
    SyntheticTask,
    char_match_reward,
    get_task,
    warmup_rollouts,
)
from megatron_branch.tasks.tool_lookup import LookupEnv, LookupTask

__all__ = [
    "TASKS",
    "CopySpanTask",
    "EvalResult",
    "KeyValueTask",
    "LookupEnv",
    "LookupTask",
    "NeedleTask",
    "PromptRow",
    "RewardFn",
    "SyntheticTask",
    "char_match_reward",
    "evaluate",
    "get_task",
    "load_reward",
    "read_prompts_jsonl",
    "score_responses",
    "warmup_rollouts",
    "write_prompts_jsonl",
]
