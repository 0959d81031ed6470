"""Tokenizers: sentencepiece trained on task text once and reused from its folder; Hugging Face tokenizer.json
through transformers, built locally (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_branch.errors import UserError
from megatron_branch.tasks import get_task
from megatron_branch.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer


@pytest.mark.parametrize("model_type", ["char", "bpe"])
def test_sentencepiece_trains_once_then_reuses(tmp_path: Path, model_type: str) -> None:
    task = get_task("kv_retrieval", num_pairs=4)
    text = task.corpus(100, seed=3)
    tok = SentencePieceTokenizer.train_or_load(tmp_path, text, model_type=model_type, vocab_size=40)
    assert isinstance(tok, Tokenizer)
    model = tmp_path / "tokenizer.model"
    stamp = model.stat().st_mtime_ns
    again = SentencePieceTokenizer.train_or_load(tmp_path, text, model_type=model_type, vocab_size=40)
    assert model.stat().st_mtime_ns == stamp  # loaded from the cache, not retrained
    assert again.encode(text[0]) == tok.encode(text[0])
    for line in text[:20]:  # exact round trips on task text (identity normalisation, spaces kept)
        ids = tok.encode(line)
        assert tok.decode(ids) == line and tok.decode([*ids, tok.eos_id, tok.pad_id]) == line
        assert max(ids) < tok.vocab_size and tok.eos_id not in ids
    assert (tok.eos_id, tok.pad_id) == (1, 2)
    if model_type == "char":  # one token per character: the vocabulary is the alphabet + unk/eos/pad
        assert len(tok.encode("k12:abc")) == 7
        assert tok.vocab_size == len(set("".join(text))) + 3
    # different text: retrained in place
    sha = json.loads((tmp_path / "spm_settings.json").read_text())["text_sha256"]
    other = get_task("copy_span").corpus(50, seed=1)
    SentencePieceTokenizer.train_or_load(tmp_path, other, model_type=model_type, vocab_size=40)
    assert json.loads((tmp_path / "spm_settings.json").read_text())["text_sha256"] != sha
    assert model.stat().st_mtime_ns != stamp


def test_sentencepiece_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="model_type"):
        SentencePieceTokenizer.train_or_load(tmp_path, ["ab"], model_type="word2")
    with pytest.raises(UserError, match="newlines"):
        SentencePieceTokenizer.train_or_load(tmp_path, ["a\nb"])
    with pytest.raises(UserError, match="not found"):
        SentencePieceTokenizer(tmp_path / "missing.model")


def _write_hf_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json with eos/pad, saved as a transformers fast tokenizer folder."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "k12": 5, ":": 6}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))


def test_hf_tokenizer_from_folder_and_file(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hello world k12 :") == [3, 4, 5, 6]
    assert tok.decode([3, 4, 1, 2]) == "hello world"
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (7, 1, 2)
    bare = HFTokenizer(tmp_path / "tokenizer.json", eos_token="</s>")  # the file alone: no config, eos given
    assert bare.encode("hello world") == [3, 4] and bare.eos_id == 1 and bare.pad_id == 1
    with pytest.raises(UserError, match="no eos token"):
        HFTokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="no tokenizer.json"):
        HFTokenizer(tmp_path / "nothing")


def test_a_tokenizer_folder_that_is_not_one_is_named_for_what_it_holds(tmp_path: Path) -> None:
    """A folder whose only tokenizer.json is not transformers' format (an old sentencepiece settings file) is refused
    for that, not as a folder "without tokenizer files" that names the file it holds; an empty one as empty."""
    from megatron_branch.checkpoint.hf_io import check_tokenizer_dir

    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "tokenizer.json").write_text('{"vocab_size": 8, "model_type": "char"}')
    with pytest.raises(UserError, match=r"tokenizer.json in .* is not a transformers tokenizer") as e:
        check_tokenizer_dir(tmp_path / "spm")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no tokenizer files"):
        check_tokenizer_dir(tmp_path / "empty")
