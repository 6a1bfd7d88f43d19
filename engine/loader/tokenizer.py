"""The model's tokenizer and chat template, from the model folder or the GGUF file.

Uses Hugging Face ``transformers`` (imported here only), offline.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.errors import WeightsError


class Tokenizer:
    def __init__(self, path: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the host
            raise WeightsError("tokenizing text needs the 'transformers' package") from e
        try:
            if path.suffix == ".gguf":
                self._tok = _gguf_tokenizer(path)
            else:
                self._tok = AutoTokenizer.from_pretrained(str(path), clean_up_tokenization_spaces=False)
        except Exception as e:
            raise WeightsError(f"cannot load a tokenizer from {path}: {e}") from None

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened."""
        if not self._tok.chat_template:
            raise WeightsError("this model has no chat template")
        out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def hf(self):
        """The underlying Hugging Face tokenizer (for tests and the reference comparison)."""
        return self._tok


def _gguf_tokenizer(path: Path):
    """Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached on disk,
    keyed by the file's identity; a damaged cache entry is rebuilt."""
    import shutil

    from transformers import AutoTokenizer

    from engine.disk_cache import cache_root, file_key

    cache = cache_root() / "tokenizers" / file_key(path)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), clean_up_tokenization_spaces=False)
        except Exception:
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)
    try:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        if cache.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tok
