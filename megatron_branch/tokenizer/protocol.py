"""The `Tokenizer` protocol: what the training loop, the sampler's callers and the tasks need from a tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. `encode` adds no special tokens; `decode` drops them (eos, pad, bos)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's unpadded vocabulary must be at least this)."""
        ...

    @property
    def eos_id(self) -> int:
        """End of sequence: the sampler's stop token; appended to supervised answers."""
        ...

    @property
    def pad_id(self) -> int:
        """Padding id (never trained on; equals eos_id where the tokenizer has no pad token)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save_hf(self, out_dir: str) -> None:
        """Write the tokenizer as a folder `transformers.AutoTokenizer.from_pretrained` loads (HF export)."""
        ...
