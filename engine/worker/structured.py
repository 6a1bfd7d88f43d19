"""Structured output: decoding constrained to a JSON schema (OpenAI's ``response_format`` json_object and
json_schema), through llguidance (the grammar engine vLLM uses as one of its backends).

A request's ``SamplingParams.json_schema`` (the schema's JSON text; ``{"type": "object"}`` for json_object) is
compiled once per request against the model's tokenizer into a matcher; before each of the request's tokens is
chosen, the logits of every token the grammar forbids at that point are set to -inf, and the chosen token then
advances the matcher. When the document is complete the grammar allows only the end-of-sequence token, so the
answer ends there. Constrained requests choose their tokens on the host, one at a time (``per_token``): no
device-side argmax, no speculative drafts.

llguidance is imported only when a request asks for a format, so the engine stays importable with torch alone.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import torch

from engine.errors import RequestError

JSON_OBJECT = '{"type": "object"}'  # response_format {"type": "json_object"}: any JSON object
_LOCK = threading.Lock()
_TOKENIZERS: dict[tuple[int, int], Any] = {}  # (id of the engine's tokenizer, vocabulary) -> llguidance's
_MATCHERS: dict[tuple[int, int, str], Any] = {}  # (tokenizer id, vocabulary, schema) -> its compiled start


def schema_text(response_format: Any) -> str | None:
    """OpenAI's ``response_format`` as the schema to constrain to: None for text (or no format). Raises
    RequestError for anything else than text, json_object or json_schema with an object schema."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object such as {\"type\": \"json_object\"}",
                           param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format json_schema needs json_schema.schema, a JSON Schema object",
                               param="response_format")
        return json.dumps(schema)
    raise RequestError(f"response_format type {str(kind)[:40]!r} is not supported; use text, json_object or "
                       "json_schema", param="response_format")


def _ll_tokenizer(tokenizer, vocab: int):
    """llguidance's view of the engine's tokenizer, built once (about a second). GGUF-converted byte-level BPE
    vocabularies carry a decoder chain (byte fallback, fuse, replace, byte-level) that llguidance does not read
    as byte-level; for a byte-level pre-tokenizer the plain byte-level decoder is the same mapping."""
    import llguidance

    key = (id(tokenizer), vocab)
    with _LOCK:
        if key not in _TOKENIZERS:
            spec = json.loads(tokenizer.hf.backend_tokenizer.to_str())
            if (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
                spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                   "use_regex": True}
            _TOKENIZERS[key] = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab,
                                                      eos_token=tokenizer.eos_token_id)
        return _TOKENIZERS[key]


def compiled(tokenizer, schema: str, vocab: int):
    """The schema's matcher at its start, compiled once per (tokenizer, schema) and kept (the last 64): each request
    takes a copy (``JsonConstraint``), so the engine's check of a request and the ``n`` choices of one share the
    compilation. Raises RequestError (param response_format) for a schema it cannot use."""
    if tokenizer is None:
        raise RequestError("response_format needs the model's tokenizer", param="response_format")
    try:
        import llguidance
    except ImportError:
        raise RequestError("response_format json_object / json_schema needs the 'llguidance' package",
                           param="response_format") from None
    key = (id(tokenizer), vocab, schema)
    with _LOCK:
        hit = _MATCHERS.pop(key, None)
        if hit is not None:
            _MATCHERS[key] = hit  # most recently used last
            return hit
    try:
        json.loads(schema)
    except ValueError as e:
        raise RequestError(f"response_format's JSON schema is not JSON: {e}", param="response_format") from None
    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab), llguidance.LLMatcher.grammar_from_json_schema(schema))
    if matcher.is_error():
        raise RequestError(f"response_format's JSON schema cannot be used: {matcher.get_error()[:300]}",
                           param="response_format")
    with _LOCK:
        _MATCHERS[key] = matcher
        while len(_MATCHERS) > 64:
            _MATCHERS.pop(next(iter(_MATCHERS)))
    return matcher


class JsonConstraint:
    """One request's grammar state: ``mask_`` its next logits, ``advance`` by the token chosen."""

    def __init__(self, tokenizer, schema: str, vocab: int) -> None:
        import llguidance.torch as llt

        self.matcher = compiled(tokenizer, schema, vocab).deep_copy()
        self._fill = llt.fill_next_token_bitmask
        self._bitmask = llt.allocate_token_bitmask(1, vocab)
        self.vocab = vocab

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Sets the logits ((vocab,) float, on any device) of the tokens the grammar forbids next to -inf, in
        place; returns them. (llguidance's own applier runs through torch.compile, a compiler on first use.)"""
        self._fill(self.matcher, self._bitmask, 0)
        allowed = _unpack(self._bitmask[0], self.vocab).to(logits.device)
        return logits.masked_fill_(~allowed, float("-inf"))

    def advance(self, token: int) -> bool:
        """Consumes the chosen token; False when the grammar refuses it (not after ``mask_``: a forced token, or
        one past the document's end when the request ignores the end-of-sequence token)."""
        return bool(self.matcher.consume_token(token))


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's bitmask ((vocab + 31) // 32 int32 words, token i at bit i % 32 of word i // 32) as bools."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, None] >> shifts) & 1).flatten()[:vocab].bool()
