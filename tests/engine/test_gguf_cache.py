"""The GGUF conversion kept on disk (engine/loader/gguf_file.py): the same tensors as converting the file, the file not
parsed again on a hit, damaged entries rebuilt, an unwritable cache and an over-bound file still loaded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.loader.gguf_file as gf

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 32, 4, 2, 48, 64, 3


def _write_tiny_gguf(path, seed: int = 0):
    """A llama GGUF of random float32 and float16 tensors, written with the gguf package's own writer."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(128)
    w.add_vocab_size(VOCAB)
    head = HIDDEN // HEADS

    def t(name, *shape, half=False):
        a = rng.standard_normal(shape).astype(np.float16 if half else np.float32)
        w.add_tensor(name, a)

    t("token_embd.weight", VOCAB, HIDDEN)
    t("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        t(f"blk.{i}.attn_norm.weight", HIDDEN)
        t(f"blk.{i}.ffn_norm.weight", HIDDEN)
        t(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, half=True)
        t(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN)
        t(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN)
        t(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        t(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        t(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, half=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path / "cache"))
    gf._reader.cache_clear()
    return _write_tiny_gguf(tmp_path / "tiny.gguf")


def _converted(path) -> dict[str, torch.Tensor]:
    """Straight from the file, no cache."""
    from pathlib import Path

    from engine.config.model_config import ModelConfig

    from engine.disk_cache import file_key

    m = gf.GGUFModel.__new__(gf.GGUFModel)
    m.path, m._key = Path(path), file_key(Path(path))
    m.config = ModelConfig.from_hf_dict(m._config())
    return dict(m._convert(None))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_hit_gives_the_files_tensors_without_parsing_it(tiny, tmp_path):
    first = gf.GGUFModel(tiny)
    assert first.config.num_hidden_layers == LAYERS and first.config.num_key_value_heads == KV_HEADS
    got = dict(first.tensors())
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    assert {p.name for p in entry.iterdir()} == {"config.json", "model.safetensors"}
    direct = _converted(tiny)
    assert _same(got, direct) and len(direct) == 2 + 9 * LAYERS
    gf._reader.cache_clear()
    again = gf.GGUFModel(tiny)
    assert _same(dict(again.tensors()), direct)
    assert gf._reader.cache_info().currsize == 0  # the configuration and the tensors both came from the cache
    assert again.config == first.config
    two = dict(again.tensors(2))  # the first layers only, as a short stack loads them
    assert _same(two, {k: v for k, v in direct.items() if ".layers.2." not in k}) and len(two) == 2 + 9 * 2
    # a new version of the file (another size and time) is another entry: never the old tensors
    _write_tiny_gguf(tiny, seed=1)
    newer = dict(gf.GGUFModel(tiny).tensors())
    assert _same(newer, _converted(tiny)) and not torch.equal(newer["model.norm.weight"], direct["model.norm.weight"])


def test_damaged_entries_are_rebuilt(tiny, tmp_path):
    direct = _converted(tiny)
    dict(gf.GGUFModel(tiny).tensors())
    (entry,) = (tmp_path / "cache" / "gguf").iterdir()
    (entry / "config.json").write_text("{not json")
    (entry / "model.safetensors").write_bytes(b"\x00" * 100)
    gf._reader.cache_clear()
    model = gf.GGUFModel(tiny)
    assert model.config.hidden_size == HIDDEN and _same(dict(model.tensors()), direct)
    gf._reader.cache_clear()
    rebuilt = gf.GGUFModel(tiny)
    assert _same(dict(rebuilt.tensors()), direct) and gf._reader.cache_info().currsize == 0


def test_an_unwritable_cache_or_an_over_bound_file_still_loads(tiny, tmp_path, monkeypatch):
    direct = _converted(tiny)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("POLYINF_CACHE", str(blocked))
    assert _same(dict(gf.GGUFModel(tiny).tensors()), direct)
    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path / "bounded"))
    monkeypatch.setenv("POLYINF_GGUF_CACHE_BYTES", "1000")
    assert _same(dict(gf.GGUFModel(tiny).tensors()), direct)
    (entry,) = (tmp_path / "bounded" / "gguf").iterdir()
    assert [p.name for p in entry.iterdir()] == ["config.json"]  # the tensors were over the bound


def test_a_bad_file_is_an_error_and_leaves_no_entry(tmp_path, monkeypatch):
    from engine.errors import WeightsError

    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        gf.GGUFModel(bad)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
