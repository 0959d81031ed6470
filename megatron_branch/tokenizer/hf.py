"""A Hugging Face tokenizer (the `tokenizer.json` of a converted model) through transformers, loaded locally."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError


class HFTokenizer:
    """Implements `Tokenizer` over `transformers.PreTrainedTokenizerFast`; nothing is downloaded.

    `folder` is a model folder (tokenizer.json, optionally tokenizer_config.json / special_tokens_map.json) or the
    path of a tokenizer.json itself. eos comes from the tokenizer's config (or `eos_token`); pad falls back to eos.
    """

    def __init__(self, folder: str | Path, *, eos_token: str | None = None) -> None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        path = Path(folder)
        try:
            if path.is_file():
                tok: Any = PreTrainedTokenizerFast(tokenizer_file=str(path))
            elif (path / "tokenizer.json").is_file():
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            else:
                raise UserError("no tokenizer.json here", where=str(path))
        except UserError:
            raise
        except Exception as exc:  # transformers raises many kinds; the user needs one line
            raise UserError(
                f"cannot load the tokenizer: {str(exc).splitlines()[0]}", where=str(path)
            ) from None
        if eos_token is not None:
            tok.eos_token = eos_token
        if tok.eos_token_id is None:
            raise UserError("the tokenizer has no eos token: pass eos_token=", where=str(path))
        self.path = path
        self._tok = tok

    @property
    def transformers(self) -> Any:
        """The transformers tokenizer itself (its chat template: data/traces.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens and ids past the vocabulary (a model's padded rows) decode to nothing."""
        n = self.vocab_size
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=True)

    def save_hf(self, out_dir: str | Path) -> None:
        """Write this tokenizer as a transformers folder (its special tokens and chat template kept)."""
        self._tok.save_pretrained(str(out_dir))
