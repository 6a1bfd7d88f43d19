"""Reading a GGUF file: its model configuration and its tensors, dequantized, under Hugging Face names.

Parsing a GGUF file's metadata takes seconds (one field per vocabulary token) and dequantizing its tensors seconds
more, in every process that loads it (the server, each pipeline step, each benchmark). So the conversion is kept:
in the process, the parsed file; on disk (``$POLYINF_CACHE/gguf``, default ``~/.cache/polyinf``), the
configuration and, for files whose float32 tensors take at most ``POLYINF_GGUF_CACHE_BYTES`` (default 2 GiB),
the converted tensors as safetensors; each keyed by the file's path, size and modification time. A damaged cache
entry is rebuilt from the file; an unwritable cache only costs the conversion next time.

Imports ``gguf`` only when called, so the engine imports without it.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.config.model_config import ModelConfig
from engine.disk_cache import cache_root, file_key, keep
from engine.errors import ConfigError, WeightsError

# GGUF architecture -> Hugging Face model_type
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


@functools.lru_cache(maxsize=4)
def _reader(path: str, key: str):
    """The file's reader, parsed once per process for each version of the file (``key``: engine.disk_cache's
    file_key); an unreadable file raises, and is not kept. The reader is only read from."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - depends on the host
        raise WeightsError("reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors on bad files
        raise WeightsError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    if f.types and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if f.types and f.types[0].name == "ARRAY":
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


CACHE_BYTES = 2 << 30  # the default bound on a file's converted (float32) tensors kept on disk


class GGUFModel:
    """A GGUF checkpoint: ``config`` and ``tensors()`` yielding float32 tensors under Hugging Face names."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"GGUF file not found: {self.path}")
        self._key = file_key(self.path)
        self._cache = cache_root() / "gguf" / self._key
        self.config = self._cached_config()
        if self.config is None:  # absent or damaged: read from the file
            raw = self._config()
            self.config = ModelConfig.from_hf_dict(raw)  # raises on a configuration the engine cannot build
            keep(self._cache / "config.json", lambda tmp: tmp.write_text(json.dumps(raw)))

    def _cached_config(self) -> ModelConfig | None:
        try:
            return ModelConfig.from_hf_dict(json.loads((self._cache / "config.json").read_text()))
        except Exception:
            return None

    @property
    def reader(self):
        """The parsed file (only when the cache does not hold what is asked)."""
        return _reader(str(self.path), self._key)

    def _config(self) -> dict:
        r = self.reader
        arch = _field(r, "general.architecture")
        if arch not in _ARCHS:
            raise ConfigError(f"unknown GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
        names = {t.name for t in r.tensors}
        hidden = _field(r, f"{arch}.embedding_length")
        heads = _field(r, f"{arch}.attention.head_count")
        if hidden is None or heads is None:
            raise WeightsError(f"{self.path}: GGUF metadata lacks {arch}.embedding_length or head_count")
        tokens = r.fields.get("tokenizer.ggml.tokens")
        vocab = _field(r, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None:
            raise WeightsError(f"{self.path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size) and no "
                               "tokenizer.ggml.tokens")
        raw: dict[str, Any] = {
            "model_type": _ARCHS[arch],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": _field(r, f"{arch}.feed_forward_length"),
            "num_hidden_layers": _field(r, f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": _field(r, f"{arch}.attention.head_count_kv", heads),
            "head_dim": _field(r, f"{arch}.attention.key_length", hidden // heads),
            "rms_norm_eps": _field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": _field(r, f"{arch}.rope.freq_base", 10000.0),
            "max_position_embeddings": _field(r, f"{arch}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        }
        if arch == "qwen3moe":
            raw.update(
                num_experts=_field(r, f"{arch}.expert_count"),
                num_experts_per_tok=_field(r, f"{arch}.expert_used_count"),
                moe_intermediate_size=_field(r, f"{arch}.expert_feed_forward_length"),
                norm_topk_prob=True,
            )
        if raw["intermediate_size"] is None:
            raw["intermediate_size"] = raw.get("moe_intermediate_size") or 1
        return raw

    def tensors(self, layers: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The first ``layers`` layers' tensors (all when None) and the others, from the cache when it holds them;
        else converted from the file (and all of them kept when they fit the cache's bound)."""
        limit = self.config.num_hidden_layers if layers is None else layers
        kept = self._cache / "model.safetensors"
        if kept.is_file():
            try:
                from safetensors import safe_open

                with safe_open(str(kept), framework="pt") as f:
                    names = [n for n in f.keys() if _layer(n) < limit]
                    got = [(n, f.get_tensor(n)) for n in names]  # read before yielding: a damaged file raises here
                yield from got
                return
            except Exception:  # damaged: converted again below
                pass
        bound = int(os.environ.get("POLYINF_GGUF_CACHE_BYTES", CACHE_BYTES))
        if 0 < sum(int(t.n_elements) for t in self.reader.tensors) * 4 <= bound:
            from safetensors.torch import save_file

            every = dict(self._convert(None))
            keep(kept, lambda tmp: save_file(every, str(tmp)))
            yield from ((n, w) for n, w in every.items() if _layer(n) < limit)
            return
        yield from self._convert(limit)

    def _convert(self, limit: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import dequantize

        cfg = self.config
        limit = cfg.num_hidden_layers if limit is None else limit
        for t in self.reader.tensors:
            name = t.name
            if name.startswith("blk."):
                _, idx, rest = name.split(".", 2)
                if int(idx) >= limit:
                    continue
                if rest not in _LAYER_NAMES:
                    raise WeightsError(f"{self.path}: unexpected tensor {name!r}")
                hf = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
            else:
                hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}.get(name)
                if hf is None:
                    continue  # e.g. rope_freqs; frequencies come from the metadata
            try:
                w = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise WeightsError(f"{self.path}: tensor {name!r} cannot be dequantized: {e}") from None
            w = np.require(w, dtype=np.float32, requirements=["C", "W"])
            if cfg.model_type == "llama" and rest_is(name, ("attn_q.weight", "attn_k.weight")):
                heads = cfg.num_attention_heads if name.endswith("attn_q.weight") else cfg.num_key_value_heads
                w = _unpermute(w, heads)
            if "{e}" in hf:
                for e in range(w.shape[0]):
                    yield hf.format(e=e), torch.from_numpy(w[e].copy())  # its own memory (kept on its own)
            else:
                yield hf, torch.from_numpy(w)

    def tokenizer_dir_and_file(self) -> tuple[str, str]:
        return str(self.path.parent), self.path.name


def _layer(name: str) -> int:
    """The decoder layer a Hugging Face tensor name belongs to (-1: none)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1


def rest_is(name: str, suffixes: tuple[str, ...]) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2] in suffixes


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in the q/k projections."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
