"""Structured output (engine/worker/structured.py): decoding constrained to a JSON schema on the real SmolLM2, against
the same prompts unconstrained, and the response_format forms the server takes or refuses."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.errors import RequestError
from engine.worker.structured import JSON_OBJECT, _unpack, schema_text

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
                                         "capital": {"type": "boolean"}},
        "required": ["city", "country", "capital"], "additionalProperties": False}
PROMPTS = ["What is the capital of France?", "Name a large city in Japan."]


def test_response_format_forms():
    assert schema_text(None) is None and schema_text({"type": "text"}) is None
    assert schema_text({"type": "json_object"}) == JSON_OBJECT
    assert json.loads(schema_text({"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})) == CITY
    for bad, msg in (({"type": "regex"}, "not supported"), ({"type": "json_schema"}, "json_schema.schema"),
                     ({"type": "json_schema", "json_schema": {"schema": "x"}}, "json_schema.schema"),
                     ("json", "must be an object")):
        with pytest.raises(RequestError, match=msg):
            schema_text(bad)


def test_bitmask_unpacking_against_a_plain_loop():
    g = torch.Generator().manual_seed(3)
    vocab = 101
    words = torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=g)
    got = _unpack(words, vocab).tolist()
    want = [bool((int(words[i // 32]) >> (i % 32)) & 1) for i in range(vocab)]
    assert got == want


def test_constrained_answers_follow_the_schema_and_plain_ones_do_not(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=128)
    plain = eng.generate(PROMPTS, SamplingParams(max_tokens=6), chat=True)
    assert all(not o.text.lstrip().startswith("{") for o in plain)  # the model does not answer in JSON by itself
    # greedy and sampled rows batched together, each request with its own grammar state
    outs = eng.generate(PROMPTS, [SamplingParams(max_tokens=48, json_schema=json.dumps(CITY)),
                                  SamplingParams(max_tokens=48, temperature=0.8, seed=5, json_schema=json.dumps(CITY))],
                        chat=True)
    answers = [json.loads(o.text) for o in outs]
    for a, o in zip(answers, outs):
        jsonschema.validate(a, CITY)
        assert o.finish_reason == "stop"  # the grammar allowed only the end once the object closed
    assert answers[0]["city"] == "Paris" and answers[0]["country"] == "France"
    # any JSON object: it opens as one (the model's own choice would be prose, above)
    obj = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=8, json_schema=JSON_OBJECT), chat=True)[0]
    assert obj.text.startswith("{") and obj.text.count('"') >= 1, obj.text
    assert not eng._constraints  # released with their requests


def test_a_schema_that_cannot_compile_is_refused_and_changes_nothing(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=64)
    for bad, msg in (('{"type": "objectx"}', "cannot be used"), ("{not json", "not JSON")):
        with pytest.raises(RequestError, match=msg):
            eng.add_request("hi", SamplingParams(json_schema=bad))
    assert not eng.has_unfinished() and not eng._constraints and not eng._seqs
