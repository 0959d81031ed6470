"""Tokenizers behind one small protocol: a sentencepiece model trained at start-up on the task's own text
(cached in a folder), and a Hugging Face `tokenizer.json` through transformers (nothing downloaded)."""

from megatron_branch.tokenizer.hf import HFTokenizer
from megatron_branch.tokenizer.protocol import Tokenizer
from megatron_branch.tokenizer.spm import SentencePieceTokenizer

__all__ = ["HFTokenizer", "SentencePieceTokenizer", "Tokenizer"]
