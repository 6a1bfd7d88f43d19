"""Real-text prompts for replays: corpora, exact lengths, shared prefixes, determinism, and the
unchanged random-id path for synthetic weights.

Costs on a 2-core CPU: loading SmolLM2's tokenizer ~9 s (once per module, mostly importing
transformers), tokenizing prose ~0.5 s and code ~1.7 s cold, ~10 ms from the disk cache.
"""
from __future__ import annotations

import random
import re
import time
from array import array
from pathlib import Path

import pytest

from engine.serving.trace_record import TraceRecord
from ops.traffic import corpus as C
from ops.traffic.corpus import Corpus, TokenStream, corpus_for, corpus_ids, text_prompts
from ops.traffic.replay import synthesize_prompts
from ops.traffic.traces import load_trace
SHARED = Path(__file__).resolve().parents[2] / "traces"
VOCAB = 49152


@pytest.fixture(scope="module")
def tok():
    from engine.loader.model_source import resolve
    from engine.loader.tokenizer import Tokenizer

    return Tokenizer(resolve("smollm2").tokenizer_path)


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    """One disk cache for the run, so the user's cache is neither used nor filled (the tokenizer,
    a module fixture, is loaded before this and keeps using the user's cache of the GGUF conversion)."""
    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path_factory.getbasetemp() / "polyinf-cache"))


def _old_synthesize_prompts(records, vocab_size, max_input=None, seed=0, low=100):
    """The random-id implementation as it was before text prompts existed."""
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    low = min(low, vocab_size // 4)
    high = vocab_size - 1
    out = []
    for r in records:
        n = r.input_tokens if max_input is None else min(r.input_tokens, max_input)
        n = max(1, n)
        ids: list[int] = []
        for h in r.prefix_block_hashes:
            if len(ids) >= n:
                break
            if h not in blocks:
                brng = random.Random(hash((seed, h)))
                blocks[h] = [brng.randint(low, high) for _ in range(r.block_tokens)]
            ids.extend(blocks[h])
        ids.extend(rng.randint(low, high) for _ in range(max(0, n - len(ids))))
        out.append(ids[:n])
    return out


def _random_records(rng: random.Random, n: int, block_tokens: int) -> list[TraceRecord]:
    """Records over a small tree of hash chains, some without hashes, lengths cutting blocks anywhere."""
    out = []
    for i in range(n):
        hashes: tuple[int, ...] = ()
        if rng.random() < 0.7:
            depth = rng.randint(1, 6)
            hashes = tuple(rng.randint(0, 2) * 100 + d * 10 + (rng.randint(0, 1) if d > 1 else 0)
                           for d in range(depth))
        n_in = rng.randint(0, (len(hashes) + 2) * block_tokens)
        out.append(TraceRecord(arrival_s=float(i), input_tokens=n_in, output_tokens=rng.randint(1, 50),
                               prefix_block_hashes=hashes, block_tokens=block_tokens if hashes else 0))
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_without_tokenizer_output_is_unchanged():
    rng = random.Random(1234)
    for trial in range(12):
        records = _random_records(rng, 40, rng.choice([1, 4, 16, 512]))
        vocab = rng.choice([64, 1000, VOCAB])
        kw = dict(max_input=rng.choice([None, 1, 30, 700]), seed=rng.randint(0, 10**6), low=rng.choice([1, 100]))
        assert synthesize_prompts(records, vocab, **kw) == _old_synthesize_prompts(records, vocab, **kw), trial


@pytest.mark.parametrize("block_tokens", [16, 512])
def test_lengths_are_exact_and_ids_in_vocabulary(tok, block_tokens):
    records = _random_records(random.Random(block_tokens), 60, block_tokens)
    for max_input in (None, 100):
        prompts = synthesize_prompts(records, VOCAB, max_input=max_input, tokenizer=tok)
        want = [max(1, r.input_tokens if max_input is None else min(r.input_tokens, max_input)) for r in records]
        assert [len(p) for p in prompts] == want
        assert all(0 <= t < VOCAB for p in prompts for t in p)


def _texts(tok, corpus: str, seed: int = 0) -> list[str]:
    records = [TraceRecord(arrival_s=0.0, input_tokens=512, output_tokens=1) for _ in range(40)]
    return [tok.decode(p) for p in synthesize_prompts(records, VOCAB, seed=seed, tokenizer=tok, corpus=corpus)]


def test_code_prompts_read_as_python_and_prose_as_english(tok):
    code, prose = _texts(tok, "code"), _texts(tok, "prose")
    # measured: 33-36 of 40 windows of 512 tokens over four seeds
    assert sum(1 for t in code if "def " in t or "import " in t) >= 28

    def word_share(t: str) -> float:
        words = t.split()
        return sum(1 for w in words if re.fullmatch(r"[A-Za-z]+[.,;:]?", w)) / max(1, len(words))

    for t in prose:
        assert sum(ch.isascii() for ch in t) / len(t) > 0.98
    assert sorted(map(word_share, prose))[len(prose) // 2] > 0.75  # measured ~0.81
    marks = lambda texts: sum(t.count("def ") + t.count("self.") for t in texts)  # noqa: E731
    assert marks(code) > 10 * marks(prose)


@pytest.mark.parametrize("block_tokens", [16, 512])
def test_shared_hashes_share_exactly_their_blocks(tok, block_tokens):
    bt = block_tokens
    mk = lambda hashes, n: TraceRecord(arrival_s=0.0, input_tokens=n, output_tokens=1,  # noqa: E731
                                       prefix_block_hashes=hashes, block_tokens=bt)
    a, b, c, d = mk((1, 2, 3), 3 * bt), mk((1, 2, 4), 3 * bt), mk((1, 2), 2 * bt + 40), mk((5, 6), 2 * bt)
    e = TraceRecord(arrival_s=0.0, input_tokens=bt, output_tokens=1)
    pa, pb, pc, pd, pe = synthesize_prompts([a, b, c, d, e], VOCAB, tokenizer=tok, corpus="prose")
    for x, y in ((pa, pb), (pa, pc), (pb, pc)):
        assert x[:2 * bt] == y[:2 * bt]
        assert _lcp(x, y) < 2 * bt + C.DISTINCT_TOKENS  # they part within the next engine block
    for x, y in ((pa, pd), (pa, pe), (pd, pe)):
        assert _lcp(x, y) < C.DISTINCT_TOKENS
    # a chain reads on: each first child of a block continues its text, so a is one window
    assert _is_window(corpus_ids("prose", tok), pa)


def _is_window(stream: TokenStream, ids: list[int]) -> bool:
    s = stream.ids.tolist()
    return any(s[i:i + 8] == ids[:8] and stream.window(i, len(ids)) == ids for i in range(len(s)))


def test_mooncake_slice_shares_what_the_trace_shares(tok):
    records = load_trace(SHARED / "mooncake_conversation_trace.jsonl")[:400]
    bt = records[0].block_tokens
    prompts = synthesize_prompts(records, VOCAB, max_input=4096, tokenizer=tok)
    order = sorted(range(len(records)), key=lambda i: records[i].prefix_block_hashes)
    for i, j in zip(order, order[1:]):  # neighbours in hash order have the longest common prefixes
        ha, hb = records[i].prefix_block_hashes, records[j].prefix_block_hashes
        k = _lcp(list(ha), list(hb))
        shared = min(k * bt, len(prompts[i]), len(prompts[j]))
        lcp = _lcp(prompts[i], prompts[j])
        assert lcp >= shared
        if shared < min(len(prompts[i]), len(prompts[j])):
            assert lcp < shared + C.DISTINCT_TOKENS


def test_deterministic_for_a_seed(tok):
    records = _random_records(random.Random(7), 50, 16)
    first = synthesize_prompts(records, VOCAB, seed=3, tokenizer=tok, corpus="code")
    C.clear_memory_cache()
    assert synthesize_prompts(records, VOCAB, seed=3, tokenizer=tok, corpus="code") == first
    assert synthesize_prompts(records, VOCAB, seed=4, tokenizer=tok, corpus="code") != first
    assert synthesize_prompts(records, VOCAB, seed=3, tokenizer=tok, corpus="prose") != first


def test_disk_cache_round_trips_and_survives_damage(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path))
    C.clear_memory_cache()
    fresh = corpus_ids(Corpus.PROSE, tok)
    files = list((tmp_path / "corpus").glob("prose-*.u32"))
    assert len(files) == 1 and files[0].stat().st_size == 4 * len(fresh)
    C.clear_memory_cache()
    real_tokenize = C._tokenize
    monkeypatch.setattr(C, "_tokenize", lambda *a: pytest.fail("tokenized again despite the disk cache"))
    t = time.perf_counter()
    again = corpus_ids(Corpus.PROSE, tok)
    assert time.perf_counter() - t < 1.0  # measured ~10 ms (hashing the corpus text and the tokenizer)
    assert again.ids == fresh.ids and again is not fresh
    monkeypatch.setattr(C, "_tokenize", real_tokenize)
    files[0].write_bytes(b"\x01\x02\x03")  # damaged: tokenized again
    C.clear_memory_cache()
    assert corpus_ids(Corpus.PROSE, tok).ids == fresh.ids
    assert corpus_ids(Corpus.PROSE, tok) is corpus_ids("prose", tok)  # and held in memory


class _ByteTokenizer:
    """A tokenizer that is not Hugging Face's: bytes, after a BOS id it adds itself."""

    def encode(self, text: str) -> list[int]:
        return [300] + [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if 0 < i < 257).decode("utf-8", "replace")


def test_any_tokenizer_with_encode_works_in_memory():
    tok = _ByteTokenizer()
    stream = corpus_ids("prose", tok)
    assert 300 not in stream.ids  # the special id is stripped from every document
    records = [TraceRecord(arrival_s=0.0, input_tokens=200, output_tokens=1)] * 9
    prompts = synthesize_prompts(records, 301, tokenizer=tok, corpus="prose")
    assert [len(p) for p in prompts] == [200] * 9
    letters = sorted(sum(c.isalpha() for c in tok.decode(p)) for p in prompts)
    assert letters[4] > 110  # bytes of English; a window in a doctest example has fewer
    assert corpus_ids("prose", tok) is stream
    with pytest.raises(ValueError, match="vocabulary"):
        synthesize_prompts(records, 200, tokenizer=tok, corpus="prose")


def test_window_wraps_and_fresh_windows_differ():
    stream = TokenStream(Corpus.PROSE, array("I", range(10)))
    assert stream.window(8, 25) == [8, 9, *range(10), *range(10), 0, 1, 2]
    assert stream.window(-1, 2) == [9, 0]
    big = TokenStream(Corpus.PROSE, array("I", range(1000)))
    records = [TraceRecord(arrival_s=0.0, input_tokens=20, output_tokens=1) for _ in range(200)]
    heads = {tuple(p[:C.DISTINCT_TOKENS]) for p in text_prompts(records, big, seed=0)}
    assert len(heads) == 200  # 200 draws of 1000 starts would collide ~18 times by chance


def test_corpus_for_names_and_records():
    assert corpus_for("traces/AzureLLMInferenceTrace_code.csv") is Corpus.CODE
    assert corpus_for(SHARED / "AzureLLMInferenceTrace_conv.csv") is Corpus.PROSE
    assert corpus_for("mooncake_conversation_trace.jsonl") is Corpus.PROSE
    assert corpus_for([TraceRecord(arrival_s=0.0, input_tokens=1, output_tokens=1, source="azure")]) is Corpus.PROSE
    assert corpus_for([TraceRecord(arrival_s=0.0, input_tokens=1, output_tokens=1, source="azure-code")]) is Corpus.CODE
    assert corpus_for([]) is Corpus.PROSE
    with pytest.raises(ValueError):
        Corpus("poetry")
