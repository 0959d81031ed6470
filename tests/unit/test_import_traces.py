"""`megatron-branch import-traces`: chat transcripts -> rollouts with loss masks from a REAL chat template.

The tokenizer is built offline here (a byte-level BPE trained on a few sentences, ChatML special tokens) and saved
as a transformers folder with a Qwen-style chat template (tools, tool calls, tool turns, and Qwen3's habit of
dropping an earlier turn's reasoning: the drift the import refuses). transformers loads it back and renders every
trace; the rollouts then train through `grad` (replay == naive, float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_branch.cli import main
from megatron_branch.data import PrefixTree, read_rollouts_jsonl

TEMPLATE = (
    "{%- set last = namespace(i=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set last.i = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- else %}You are helpful.{%- endif %}"
    "{%- if tools %}\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}{%- set c = m.content or '' %}"
    "{%- if loop.index0 < last.i and '</think>' in c %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "<|im_start|>assistant\n{{ c }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"key": "string"}}}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful agent. Use the lookup tool to find the answer.",
        "What is the capital? Let me look it up. The answer is Paris.",
        '{"name": "lookup", "arguments": {"key": "capital"}} tool_call think',
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
    )
    fast.save_pretrained(out)
    return out


def trace(question: str, answer: str, *, think: str = "", advantage: float = 1.0) -> dict:
    call = {"function": {"name": "lookup", "arguments": {"key": "capital"}}}
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"{think}Let me look it up.", "tool_calls": [call]},
            {"role": "tool", "content": "Paris"},
            {"role": "assistant", "content": answer},
        ],
        "tools": TOOLS,
        "advantage": advantage,
    }


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.splitlines() if ln.strip()]
    return rc, (json.loads(lines[-1]) if rc == 0 else {}), cap.err.strip()


def test_assistant_tokens_trained_tool_and_user_tokens_context(tok_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    traces = tmp_path / "traces.jsonl"
    rows = [
        trace("What is the capital?", "The answer is Paris."),
        trace("What is the capital?", "Paris.", advantage=-1),
    ]
    traces.write_text("".join(json.dumps(t) + "\n" for t in rows))
    out = tmp_path / "rollouts.jsonl"
    rc, summary, err = run(
        ["import-traces", "--traces", str(traces), "--tokenizer", str(tok_dir), "--out", str(out)], capsys
    )
    assert rc == 0, err
    rollouts = read_rollouts_jsonl(out)
    assert summary["rollouts"] == 2 and 0 < summary["trained_token_fraction"] < 1
    r = rollouts[0]
    assert r.advantage == 1.0 and rollouts[1].advantage == -1.0
    full = hf.apply_chat_template(rows[0]["messages"], tools=TOOLS, tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full  # a BatchEncoding in newer transformers
    assert list(r.prompt + r.response) == list(full)
    assert hf.decode(r.prompt).endswith("<|im_start|>assistant\n")  # the generation prompt ends the prompt
    trained = "".join(hf.decode([t]) for t, m in zip(r.response, r.loss_mask) if m)
    context = "".join(hf.decode([t]) for t, m in zip(r.response, r.loss_mask) if not m)
    assert trained == 'Let me look it up.<tool_call>{"name": "lookup", "arguments": {"key": "capital"}}</tool_call>' \
        "<|im_end|>The answer is Paris.<|im_end|>"  # fmt: skip
    assert (
        "Paris<|im_end|>" in context and "<|im_start|>tool" in context and "<|im_start|>assistant" in context
    )
    tree = PrefixTree.build(rollouts)
    assert tree.positions_computed < tree.positions_logical  # system prompt, tools and the first turns shared
    assert summary["positions_computed"] == tree.positions_computed


def test_drifting_trace_refused_in_one_line(tok_dir: Path, tmp_path: Path, capsys) -> None:
    """The template drops the first turn's reasoning once a later assistant turn exists: refused, nothing written."""
    traces = tmp_path / "traces.jsonl"
    good = trace("What is the capital?", "Paris.")
    bad = trace("What is the capital?", "Paris.", think="<think>look</think>")
    traces.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    out = tmp_path / "rollouts.jsonl"
    rc, _, err = run(
        ["import-traces", "--traces", str(traces), "--tokenizer", str(tok_dir), "--out", str(out)], capsys
    )
    assert rc == 2 and "\n" not in err and err.startswith("megatron-branch: error:"), err
    assert f"{traces}:2" in err and "turn 2 (assistant)" in err and "differently" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("line", "word"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        (
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
            "content must",
        ),
    ],
)
def test_malformed_traces_refused(tok_dir: Path, tmp_path: Path, capsys, line: dict, word: str) -> None:
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps(line) + "\n")
    rc, _, err = run(
        [
            "import-traces",
            "--traces",
            str(traces),
            "--tokenizer",
            str(tok_dir),
            "--out",
            str(tmp_path / "o.jsonl"),
        ],
        capsys,
    )
    assert rc == 2 and f"{traces}:1" in err and word in err and "\n" not in err, err


@pytest.mark.slow
def test_imported_traces_train_through_grad(tok_dir: Path, tmp_path: Path, capsys) -> None:
    """The rollouts of two traces through `grad`: replay == naive (float64), the masks from the chat template."""
    import torch
    from safetensors.torch import load_file

    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    traces = tmp_path / "traces.jsonl"
    rows = [
        trace("What is the capital?", "The answer is Paris."),
        trace("What is the capital?", "Paris.", advantage=-1),
    ]
    traces.write_text("".join(json.dumps(t) + "\n" for t in rows))
    out = tmp_path / "r.jsonl"
    assert (
        run(
            ["import-traces", "--traces", str(traces), "--tokenizer", str(tok_dir), "--out", str(out)], capsys
        )[0]
        == 0
    )
    tiny_hf_model(tiny_hf_config("qwen2", vocab_size=300), seed=3).save_pretrained(tmp_path / "hf")
    grads = {}
    for schedule in ("naive", "replay"):
        argv = ["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(out), "--out", str(tmp_path / f"{schedule}.st"),
                "--dtype", "float64", "--schedule", schedule]  # fmt: skip
        rc, summary, err = run(argv, capsys)
        assert rc == 0, err
        assert 0 < summary["metrics"]["tree/trained_token_fraction"] < 1
        grads[schedule] = load_file(tmp_path / f"{schedule}.st")
    for n, g in grads["naive"].items():
        assert ((grads["replay"][n] - g).norm() / g.norm()).item() <= 1e-9, n
    assert any(g.abs().sum() > 0 for g in grads["naive"].values()) and grads["naive"]
    assert all(t.dtype == torch.float64 for t in grads["naive"].values())
