"""Offline text corpora as token streams, and prompts of real text cut from them.

A replay against a real model needs real text: random token ids make its output lengths and,
later, its speculation acceptance meaningless. Two corpora ship with every CPython, so nothing
is downloaded:

- ``code``: the standard library's own top-level modules (``sysconfig`` ``stdlib`` path),
  public ones only (no leading underscore), whole files in name order up to
  ``CODE_CHAR_BUDGET`` characters (about 400k tokens for SmolLM2).
- ``prose``: ``pydoc_data.topics``, the language reference and library documentation as
  English text, topics in name order, table rows dropped (about 105k tokens for SmolLM2).

The texts differ between Python versions, so prompts are reproducible per installation.
A corpus is tokenized once per (corpus, tokenizer) into one id stream, kept in memory and on
disk under ``$POLYINF_CACHE/corpus`` (default ``~/.cache/polyinf``), keyed by hashes of the
corpus text and of the tokenizer's serialized form.
"""
from __future__ import annotations

import glob
import hashlib
import os
import random
import sys
import sysconfig
import weakref
from array import array
from dataclasses import dataclass
from functools import cached_property
from enum import Enum
from pathlib import Path
from typing import Iterator, Protocol, Sequence

from engine.disk_cache import cache_root
from engine.serving.trace_record import TraceRecord

CODE_CHAR_BUDGET = 1_500_000
DISTINCT_TOKENS = 16  # the engine's default KV block: fresh windows differ within it, so none is shared by accident
_PLACE_TRIES = 64
_FORMAT = "u32le-v2"  # bump when the on-disk layout or the corpus rules change


class Corpus(str, Enum):
    CODE = "code"
    PROSE = "prose"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class TokenStream:
    """One corpus as token ids; windows wrap around its end."""

    corpus: Corpus
    ids: array  # uint32, the documents' ids back to back, no special tokens

    def __post_init__(self) -> None:
        if len(self.ids) == 0:
            raise ValueError(f"corpus {self.corpus.value!r} tokenized to no ids")

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def max_id(self) -> int:
        return max(self.ids)

    def window(self, start: int, n: int) -> list[int]:
        """n ids from position start (mod the stream's length), wrapping as often as needed."""
        start %= len(self.ids)
        out = self.ids[start:start + n].tolist()
        while len(out) < n:
            out.extend(self.ids[:n - len(out)].tolist())
        return out


def corpus_texts(corpus: Corpus | str) -> list[str]:
    """The corpus's documents in their fixed order."""
    corpus = Corpus(corpus)
    if corpus is Corpus.PROSE:
        from pydoc_data.topics import topics

        # table rows are whitespace-padded grids, not prose: dropped
        return ["".join(line for line in topics[k].splitlines(keepends=True)
                        if not line.lstrip().startswith(("|", "+-", "+="))) for k in sorted(topics)]
    texts, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        if os.path.basename(path).startswith("_"):
            continue  # private and generated modules (_pydecimal, _sysconfigdata_*) are not typical code
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if total + len(text) > CODE_CHAR_BUDGET and texts:
            break
        texts.append(text)
        total += len(text)
    return texts


def corpus_for(records_or_name: Sequence[TraceRecord] | str | os.PathLike) -> Corpus:
    """The corpus that fits a trace. The Azure LLM-inference dataset publishes its two services as
    ``..._code.csv`` and ``..._conv.csv`` and the rows carry no other label, so for a file the rule
    reads the name: ``code`` in the file name (or a record's ``source``) means code; everything
    else (Azure conversation, Mooncake, captures) is conversation and gets prose. Pass ``corpus=``
    explicitly to override."""
    if isinstance(records_or_name, (str, os.PathLike)):
        labels = [Path(records_or_name).name]
    else:
        labels = [r.source for r in records_or_name]
    code = sum(1 for s in labels if "code" in s.lower())
    return Corpus.CODE if labels and 2 * code > len(labels) else Corpus.PROSE


_memory: dict[tuple[Corpus, str], TokenStream] = {}
_anonymous: "weakref.WeakKeyDictionary[object, dict[Corpus, TokenStream]]" = weakref.WeakKeyDictionary()


def corpus_ids(corpus: Corpus | str, tokenizer: TextTokenizer) -> TokenStream:
    """The corpus tokenized by ``tokenizer``, cached in memory and, for a Hugging Face tokenizer
    (whose serialized form names it exactly), on disk."""
    corpus = Corpus(corpus)
    fp = _fingerprint(tokenizer)
    if fp is None:  # a tokenizer we cannot name: cache per object, in memory only
        try:
            per = _anonymous.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: no cache
            per = {}
        if corpus not in per:
            per[corpus] = TokenStream(corpus, _tokenize(corpus_texts(corpus), tokenizer))
        return per[corpus]
    if (corpus, fp) in _memory:
        return _memory[(corpus, fp)]
    texts = corpus_texts(corpus)
    h = hashlib.sha256(f"{_FORMAT}\0{corpus.value}\0{fp}\0".encode())
    for t in texts:
        h.update(t.encode("utf-8", "replace"))
        h.update(b"\0")
    path = _cache_dir() / f"{corpus.value}-{h.hexdigest()[:20]}.u32"
    ids = _read_ids(path)
    if ids is None:
        ids = _tokenize(texts, tokenizer)
        _write_ids(path, ids)
    stream = _memory[(corpus, fp)] = TokenStream(corpus, ids)
    return stream


def clear_memory_cache() -> None:
    _memory.clear()
    _anonymous.clear()


def text_prompts(records: Sequence[TraceRecord], stream: TokenStream, max_input: int | None = None,
                 seed: int = 0) -> list[list[int]]:
    """Token ids per record, real text of exactly the recorded (clipped) length.

    Blocks named by the same hash id are the same window, so shared prefixes stay shared,
    block-aligned as the trace names them. A new block continues the text of the block before
    it unless another block already does (so a chain reads on across block boundaries and a
    second branch starts afresh), else it starts at a position drawn from (seed, hash id). The
    unhashed remainder starts at a fresh position drawn per request. Fresh positions are chosen
    so that no two windows after the same block (or at a prompt's start) begin with the same
    ``DISTINCT_TOKENS`` ids: sharing appears only where the trace has it.
    """
    rng = random.Random(seed)
    starts: dict[int, int] = {}  # hash id -> where its block starts in the stream
    taken: set[tuple] = set()  # (hash id before, first ids) of every window placed so far
    out = []
    for r in records:
        n = max(1, r.input_tokens if max_input is None else min(r.input_tokens, max_input))
        ids: list[int] = []
        prev: int | None = None  # the hash id of the block before; None at the prompt's start
        for h in r.prefix_block_hashes:
            if len(ids) >= n:
                break
            if h not in starts:
                brng = random.Random(hash((seed, h)))
                follow = [starts[prev] + r.block_tokens] if prev is not None else []
                starts[h] = _place(stream, prev, taken, follow, brng)
            ids.extend(stream.window(starts[h], r.block_tokens))
            prev = h
        if len(ids) < n:
            ids.extend(stream.window(_place(stream, prev, taken, [], rng), n - len(ids)))
        out.append(ids[:n])
    return out


def _place(stream: TokenStream, prev: int | None, taken: set[tuple], first: list[int], rng: random.Random) -> int:
    """The first candidate start (``first``, then random draws) whose opening ids are new after
    ``prev``; a stream too small to keep them apart gets the last draw."""
    start = 0
    for start in _candidates(first, rng, len(stream)):
        key = (prev, *stream.window(start, DISTINCT_TOKENS))
        if key not in taken:
            taken.add(key)
            break
    return start % len(stream)


def _candidates(first: list[int], rng: random.Random, length: int) -> Iterator[int]:
    yield from first
    for _ in range(_PLACE_TRIES):
        yield rng.randrange(length)


def _tokenize(texts: list[str], tokenizer: TextTokenizer) -> array:
    hf = _hf(tokenizer)
    if hf is not None:  # batch encoding runs in parallel, without special tokens
        encoded = hf(texts, add_special_tokens=False)["input_ids"]
    else:  # a plain encode() may add special tokens: strip what it adds to empty text
        special = set(tokenizer.encode(""))
        encoded = []
        for t in texts:
            e = list(tokenizer.encode(t))
            while e and e[0] in special:
                e.pop(0)
            while e and e[-1] in special:
                e.pop()
            encoded.append(e)
    ids = array("I")
    for e in encoded:
        ids.extend(e)
    return ids


def _hf(tokenizer: object):
    """The Hugging Face tokenizer behind ``tokenizer`` (the engine's wraps one as ``.hf``), or None."""
    for cand in (getattr(tokenizer, "hf", None), tokenizer):
        if cand is not None and hasattr(cand, "backend_tokenizer") and callable(cand):
            return cand
    return None


_fingerprints: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


def _fingerprint(tokenizer: object) -> str | None:
    """sha256 of the tokenizer's serialized form (its tokenizer.json), or None when it has none."""
    try:
        return _fingerprints[tokenizer]
    except (KeyError, TypeError):
        pass
    hf = _hf(tokenizer)
    if hf is None:
        return None
    fp = hashlib.sha256(hf.backend_tokenizer.to_str().encode()).hexdigest()
    try:
        _fingerprints[tokenizer] = fp
    except TypeError:
        pass  # not weak-referenceable: hashed again next time (tens of milliseconds)
    return fp


def _cache_dir() -> Path:
    return cache_root() / "corpus"


def _read_ids(path: Path) -> array | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data or len(data) % 4:
        return None  # damaged: tokenized again
    ids = array("I")
    if ids.itemsize != 4:
        return None
    ids.frombytes(data)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def _write_ids(path: Path, ids: array) -> None:
    if ids.itemsize != 4:
        return  # a platform whose 'I' is not 32-bit only loses the disk cache
    out = array("I", ids)
    if sys.byteorder != "little":
        out.byteswap()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_bytes(out.tobytes())
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the tokenization next time
