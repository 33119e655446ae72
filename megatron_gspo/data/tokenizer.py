"""Tokenizers: characters for the synthetic tasks, sentencepiece, or a Hugging Face
``tokenizer.json``. All expose the same small interface."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from megatron_gspo.runtime.errors import InputError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One id per character of a fixed alphabet, after <pad>=0, <bos>=1, <eos>=2."""

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet characters must be distinct")
        self.alphabet = alphabet
        self._ids = {c: i + 3 for i, c in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + 3
        self.eos_id, self.bos_id = self.EOS, self.BOS

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise InputError(f"character {e.args[0]!r} is not in the alphabet") from None

    def decode(self, ids: list[int]) -> str:
        # Ids outside the alphabet (a model's vocabulary may be larger) decode to "?" so that a
        # reward sees them; the end-of-sequence id ends the text.
        out = []
        for i in ids:
            if i == self.EOS:
                break
            out.append(self.alphabet[i - 3] if 3 <= i < len(self.alphabet) + 3 else "?")
        return "".join(out)


class SentencePieceTokenizer:
    def __init__(self, path: str | Path) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        bos = self._sp.bos_id()
        self.bos_id = bos if bos >= 0 else None
        if self.eos_id < 0:
            raise InputError(f"{path}: the sentencepiece model has no end-of-sequence piece")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([i for i in ids if 0 <= i < self.vocab_size])


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (fast tokenizer), read with the ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                f"{path}: reading tokenizer.json needs the 'tokenizers' package "
                "(pip install tokenizers)"
            ) from e
        path = Path(path)
        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id, self.bos_id = self._special_ids(path)

    def _special_ids(self, path: Path) -> tuple[int, int | None]:
        # tokenizer_config.json beside it names the special tokens when there is one.
        names = {"eos": ["<|endoftext|>", "</s>", "<eos>"], "bos": ["<s>", "<bos>"]}
        cfg = path.with_name("tokenizer_config.json")
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            for key in ("eos", "bos"):
                token = data.get(f"{key}_token")
                if isinstance(token, dict):
                    token = token.get("content")
                if token:
                    names[key].insert(0, token)
        found = {
            key: next((i for t in cands if (i := self._tok.token_to_id(t)) is not None), None)
            for key, cands in names.items()
        }
        if found["eos"] is None:
            raise InputError(f"{path}: no end-of-sequence token found (tried {names['eos']})")
        return found["eos"], found["bos"]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_text(self, token_id: int) -> str:
        """The text of one token as a chat template writes it (special tokens included)."""
        text = self._tok.id_to_token(token_id)
        if text is None:
            raise InputError(f"token id {token_id} is not in the tokenizer's vocabulary")
        return text

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: tokenizer file not found")
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        if path.suffix == ".json":
            return HFTokenizer(path)
        return SentencePieceTokenizer(path)
    except (OSError, RuntimeError, ValueError) as e:
        raise InputError(f"{path}: cannot load the tokenizer: {e}") from None
