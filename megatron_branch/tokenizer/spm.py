"""A sentencepiece tokenizer trained at start-up on text the task generates, cached in a folder.

`SentencePieceTokenizer.train_or_load(folder, texts, ...)` trains once (a few seconds for the embedded task) and
writes `folder/tokenizer.model` with `folder/spm_settings.json` (the settings and a SHA-256 of the training text;
not named `tokenizer.json`, which transformers would take for its own format);
the next call with the same settings and text loads the cached model instead. Different settings or text retrain
(into a temporary file, renamed into place, so a crash never leaves a half-written model).

The model is trained for exact round trips: identity normalisation, no dummy prefix, whitespace kept, digits split
(`decode(encode(s)) == s` for text of the training alphabet). Ids: unk 0, eos 1, pad 2, no bos.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.outputs import apply_umask

UNK_ID, EOS_ID, PAD_ID = 0, 1, 2
SETTINGS_FILE = "spm_settings.json"


class SentencePieceTokenizer:
    """Implements `Tokenizer` over a sentencepiece model file."""

    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm

        path = Path(model_file)
        if not path.is_file():
            raise UserError("sentencepiece model not found", where=str(path))
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))

    @classmethod
    def train_or_load(
        cls,
        folder: str | Path,
        texts: Iterable[str],
        *,
        vocab_size: int = 64,
        model_type: str = "char",
        user_symbols: Sequence[str] = (),
    ) -> SentencePieceTokenizer:
        """Train on `texts` (one sentence each, no newlines) unless `folder` holds a model trained on the same
        text with the same settings. `model_type`: "char" (one token per character: the embedded tasks' choice),
        "bpe" or "unigram". For "char" the vocabulary is the training alphabet and `vocab_size` is ignored."""
        import sentencepiece as spm

        if model_type not in ("char", "bpe", "unigram"):
            raise UserError(f"tokenizer model_type must be char, bpe or unigram, got {model_type!r}")
        lines = [t for t in texts]
        if not lines or any("\n" in t for t in lines):
            raise UserError("tokenizer training text must be a non-empty list of lines without newlines")
        digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
        settings = {"vocab_size": vocab_size, "model_type": model_type, "user_symbols": list(user_symbols),
                    "text_sha256": digest, "format": 1}  # fmt: skip
        folder = Path(folder)
        model, meta = folder / "tokenizer.model", folder / SETTINGS_FILE
        if model.is_file() and meta.is_file():
            try:
                if json.loads(meta.read_text(encoding="utf-8")) == settings:
                    return cls(model)
            except (OSError, json.JSONDecodeError):
                pass  # unreadable metadata: retrain
        folder.mkdir(parents=True, exist_ok=True)
        alphabet = len(set("".join(lines)))
        kw = dict(
            sentence_iterator=iter(lines),
            model_type=model_type,
            # char: the alphabet + unk/eos/pad; bpe/unigram: as asked (sentencepiece refuses too small a size)
            vocab_size=alphabet + 3 + len(user_symbols) if model_type == "char" else vocab_size,
            character_coverage=1.0,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=True,
            unk_id=UNK_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            bos_id=-1,
            user_defined_symbols=list(user_symbols),
            num_threads=1,
            minloglevel=2,
            hard_vocab_limit=model_type != "char",
        )
        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(model_writer=buf, **kw)
        except RuntimeError as exc:
            raise UserError(
                f"sentencepiece training failed: {str(exc).splitlines()[0]}", where=str(folder)
            ) from None
        for target, data in ((model, buf.getvalue()), (meta, json.dumps(settings, indent=1).encode("utf-8"))):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            apply_umask(tmp)  # mkstemp made it 0600
            os.replace(tmp, target)  # atomic: readers see the old file or the new one, never half of one
        return cls(model)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        pad = int(self._sp.pad_id())
        return pad if pad >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens and ids past the vocabulary (a model's padded rows) decode to nothing."""
        special = {self.eos_id, self.pad_id, int(self._sp.bos_id())}
        n = self.vocab_size
        return self._sp.decode([int(i) for i in ids if int(i) not in special and 0 <= int(i) < n])

    def save_hf(self, out_dir: str | Path) -> None:
        """Write this tokenizer as a transformers folder (tokenizer.json + tokenizer_config.json) that
        `AutoTokenizer.from_pretrained` loads without sentencepiece: transformers' own conversion of the model
        proto (`SpmConverter.build_tokenizer_from_spm_proto`, which follows the model's normaliser settings, so
        ids are the same), with our unk / eos / pad as its special tokens."""
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

        proto = import_protobuf().ModelProto()
        proto.ParseFromString(self.path.read_bytes())
        vocab: Any = [(p.piece, p.score) for p in proto.pieces]
        if (
            proto.trainer_spec.model_type == 2
        ):  # BPE: the converter takes {piece: id} and ranks merges by score
            vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=False)
        if backend is None:  # pragma: no cover - a model type transformers cannot build
            raise UserError("transformers cannot convert this sentencepiece model", where=str(self.path))
        sp = self._sp
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            unk_token=sp.id_to_piece(sp.unk_id()),
            eos_token=sp.id_to_piece(sp.eos_id()),
            pad_token=sp.id_to_piece(sp.pad_id()) if sp.pad_id() >= 0 else None,
            bos_token=sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
        )
        tok.save_pretrained(str(out_dir))
