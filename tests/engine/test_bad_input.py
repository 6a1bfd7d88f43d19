"""Bad input gets one clear error: from the library as an EngineError, from the CLI as a line and exit 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, resolve
from engine.config.model_config import ModelConfig
from engine.errors import ConfigError, RequestError, WeightsError

TINY = {"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _write_model(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).save_pretrained(tmp_path)
    return tmp_path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, timeout=300)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt_neox",
                                                      "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ConfigError, match="unknown architecture"):
        LLMEngine(EngineConfig(source=resolve(str(tmp_path))))


def test_config_errors():
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in TINY.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="multiple of"):
        ModelConfig.from_hf_dict({**TINY, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="rope scaling"):
        ModelConfig.from_hf_dict({**TINY, "rope_scaling": {"rope_type": "yarn-unknown", "factor": 2.0}})
    with pytest.raises(ConfigError, match="wrong type or value: ZeroDivisionError"):
        ModelConfig.from_hf_dict({**TINY, "num_attention_heads": 0})
    with pytest.raises(ConfigError, match="wrong type or value: AttributeError"):
        ModelConfig.from_hf_dict({**TINY, "rope_scaling": "linear"})


def test_expert_outside_the_config():
    """A checkpoint's expert index beyond the config's expert count is a WeightsError naming the tensor."""
    from pathlib import Path

    from engine.loader.weights import assemble

    cfg = ModelConfig.from_file(Path(__file__).parent / "tiny_moe" / "config.json")
    name = f"model.layers.0.mlp.experts.{cfg.num_experts}.down_proj.weight"
    with pytest.raises(WeightsError, match=f"{name}' is outside"):
        assemble(cfg, [(name, torch.zeros(cfg.hidden_size, cfg.moe_intermediate_size))], torch.device("cpu"),
                 torch.float32)


def test_missing_weights_file(tmp_path):
    model = _write_model(tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no .safetensors files"):
        LLMEngine(EngineConfig(source=resolve(str(model))))


def test_corrupt_safetensors(tmp_path):
    model = _write_model(tmp_path)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:8] + b"{garbage" + data[16:200])
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        LLMEngine(EngineConfig(source=resolve(str(model))))
    (model / "model.safetensors").write_bytes(data[:-100])  # a whole header, the data cut short
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        LLMEngine(EngineConfig(source=resolve(str(model))))
    # a sharded checkpoint whose index names a shard that is not there
    (model / "model.safetensors").write_bytes(data)
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors named by the index is missing"):
        LLMEngine(EngineConfig(source=resolve(str(model))))


def test_weights_that_do_not_fit_the_config(tmp_path):
    model = _write_model(tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="missing"):
        LLMEngine(EngineConfig(source=resolve(str(model))))
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 2, 40
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="shape"):
        LLMEngine(EngineConfig(source=resolve(str(model))))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(WeightsError, match="not a readable GGUF"):
        LLMEngine(EngineConfig(source=resolve(str(bad))))
    truncated = tmp_path / "truncated.gguf"
    from engine.loader.model_source import smollm2_gguf_path

    with open(smollm2_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(2_000_000))
    with pytest.raises(WeightsError):
        LLMEngine(EngineConfig(source=resolve(str(truncated))))


def test_request_errors(tmp_path):
    eng = LLMEngine(EngineConfig(source=resolve(str(_write_model(tmp_path))), num_kv_blocks=16))
    with pytest.raises(RequestError, match="context is 64 tokens"):
        eng.add_request(list(range(1, 50)) * 2, SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="exceeds the context"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=62))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        eng.add_request([1, 999], SamplingParams())
    with pytest.raises(RequestError, match="no tokenizer"):
        eng.add_request("text without a tokenizer")
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0),
                dict(top_p=1.5), dict(top_k=-2), dict(stop=("",)), dict(seed=2**64), dict(seed=-1),
                dict(seed=1.5)):
        with pytest.raises(RequestError):
            SamplingParams(**bad)
    assert not eng.has_unfinished()  # nothing half-added


def _main(capsys, *args: str) -> tuple[int, str]:
    """The CLI's ``main`` in this process (what ``python -m pipelines.cli`` runs, without a new interpreter's
    imports per case): its exit status and stderr. An exception it lets out fails the test, as the traceback
    it would print fails the subprocess's check."""
    from pipelines.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path, capsys):
    cases = [
        (["--model", str(tmp_path / "nope"), "--prompt", "hi"], "model not found"),
        (["--model", "smollm2", "--prompt", "hi", "--temperature", "-1"], "temperature must be"),
        (["--model", "smollm2", "--prompt", "hi", "--top-p", "2"], "top_p must be"),
        (["--model", "smollm2", "--prompt", "word " * 9000], "context is 8192 tokens"),
    ]
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({**TINY, "model_type": "bloom"}))
    cases.append((["--model", str(tmp_path / "unknown"), "--prompt", "1 2"], "unknown architecture"))
    cases.append((["--model", "llama-3.1-8b", "--synthetic", "--layers", "1", "--prompt", "hello"],
                  "give --prompt as token ids"))
    r = _cli("generate", *cases[0][0])  # the first case through the real entry point, a process of its own
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    for args, message in cases:
        rc, err = _main(capsys, "generate", *args)
        assert rc == 2, err
        assert message in err
        assert "Traceback" not in err
    bad_variant = tmp_path / "v.json"
    for text, message in (('{"kernels": "abc"}', "must be objects"), ('{"cuda_graph_batch_sizes": 5}', "bad variant"),
                          ('{"kernels": {"attention": 5}}', "map names to strings")):
        bad_variant.write_text(text)
        rc, err = _main(capsys, "variants", "show", "--variant", str(bad_variant))
        assert rc == 2 and message in err and "Traceback" not in err, err
    for args, message in ((["--max-concurrency", "-1"], "--max-concurrency: must be at least 1"),
                          (["--vocab-size", "0"], "--vocab-size: must be at least 1"),
                          (["--time-scale", "-2"], "--time-scale: must be a finite number >= 0")):
        rc, err = _main(capsys, "replay", "--trace", "t.csv", "--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                        *args)
        assert rc == 2 and message in err and "Traceback" not in err, err


@pytest.mark.slow  # the CLI as a process, loading SmolLM2 there
def test_cli_generate_json_matches_engine(smollm2_engine_factory):
    r = _cli("generate", "--model", "smollm2", "--prompt", "What is the capital of France?", "--chat", "--json",
             "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    eng = smollm2_engine_factory(num_kv_blocks=32)
    ref = eng.generate(["What is the capital of France?"], SamplingParams(max_tokens=16), chat=True)[0]
    assert out["token_ids"] == ref.token_ids
    assert out["prompt_token_ids"] == ref.prompt_token_ids
    assert out["text"] == "The capital of France is Paris."


def test_engine_loop_survives_a_request_that_fails_to_add(tmp_path):
    """The serving loop: a request whose add fails (an injected fault) gets its error; the loop and the other
    requests go on."""
    import asyncio

    from engine.serving.async_engine import AsyncEngine

    eng = LLMEngine(EngineConfig(source=resolve(str(_write_model(tmp_path))), num_kv_blocks=16))
    real = eng.add_request

    def add_request(ids, params=None, request_id=None, **kw):
        if ids == [7, 7]:
            raise RuntimeError("injected add failure")
        return real(ids, params, request_id=request_id, **kw)

    eng.add_request = add_request
    aeng = AsyncEngine(eng)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def serve():
        _, bad = aeng.submit([7, 7], params)
        _, good = aeng.submit([1, 2, 3], params)
        failed = await asyncio.wait_for(bad.get(), 60)
        while not (out := await asyncio.wait_for(good.get(), 60)).finished:
            pass
        return failed, out

    try:
        failed, out = asyncio.run(serve())
        assert isinstance(failed, RuntimeError) and "injected" in str(failed)
        assert len(out.token_ids) == 4 and aeng._thread.is_alive()
    finally:
        aeng.shutdown()


def test_hugging_face_ids_from_the_local_cache_only(tmp_path, monkeypatch):
    """A model id resolves to its snapshot in the local Hugging Face cache; one not there is a clear error, and
    nothing is fetched (the hub is offline here)."""
    snap = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "0123abc"
    _write_model(snap)
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve("acme/tiny-llama")
    assert src.kind == "safetensors" and src.path == snap
    eng = LLMEngine(EngineConfig(source=src, num_kv_blocks=8, load_tokenizer=False))
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    with pytest.raises(WeightsError, match="local Hugging Face cache"):
        resolve("acme/not-downloaded")


def test_vllm_flag_spellings():
    """serve MODEL (positional), --dtype auto, --quantization as --weight-dtype, --gpu-memory-utilization refused
    off a GPU with a clear error."""
    import argparse

    from pipelines.cli.args import add_model_args, engine_config

    p = argparse.ArgumentParser()
    add_model_args(p, positional=True)
    cfg = engine_config(p.parse_args(["smollm2", "--dtype", "auto", "--quantization", "int8"]))
    assert cfg.dtype == "float32" and cfg.variant.weight_dtype == "int8" and cfg.source.kind == "gguf"
    fp8 = engine_config(p.parse_args(["smollm2", "--quantization", "fp8", "--fp8-accumulation", "fast"])).variant
    assert (fp8.weight_dtype, fp8.fp8_accumulation) == ("fp8", "fast")
    with pytest.raises(ConfigError, match="fp8_accumulation fast applies to weight_dtype fp8, not int8"):
        engine_config(p.parse_args(["smollm2", "--quantization", "int8", "--fp8-accumulation", "fast"]))
    with pytest.raises(ConfigError, match="given twice"):
        engine_config(p.parse_args(["smollm2", "--model", "llama-3.1-8b"]))
    with pytest.raises(ConfigError, match="no model"):
        engine_config(p.parse_args([]))
    with pytest.raises(ConfigError, match="applies to a GPU"):
        engine_config(p.parse_args(["smollm2", "--gpu-memory-utilization", "0.9"]))
    with pytest.raises(SystemExit):
        p.parse_args(["smollm2", "--gpu-memory-utilization", "1.5"])
    # -tp / -dp: the variant's tp and dp; a model the ranks cannot divide is refused before any process starts
    tp = argparse.ArgumentParser()
    add_model_args(tp, positional=True, parallel=True)
    assert engine_config(tp.parse_args(["smollm2", "-tp", "2"])).initial_variant().tp == 2
    assert engine_config(tp.parse_args(["smollm2", "--tensor-parallel-size", "1"])).initial_variant().tp == 1
    assert engine_config(tp.parse_args(["smollm2", "-dp", "2", "-tp", "3"])).initial_variant().dp == 2
    from pipelines.cli import build_parser

    cli = build_parser()
    with pytest.raises(ConfigError, match=r"tp=2 does not divide num_attention_heads \(9\)"):  # SmolLM2: 9 heads
        args = cli.parse_args(["serve", "smollm2", "-tp", "2"])
        args.func(args)
    args = cli.parse_args(["generate", "--model", "smollm2", "-dp", "2", "--prompt", "hi"])
    with pytest.raises(ConfigError, match="data-parallel replicas"):
        args.func(args)


def test_api_key_guards_the_openai_routes(tmp_path, monkeypatch):
    """With --api-key (or $VLLM_API_KEY) the /v1 routes need the bearer key, checked before the body is read; the
    health and metrics routes stay open; the key never appears in a response."""
    from fastapi.testclient import TestClient

    from engine.serving.async_engine import AsyncEngine
    from engine.entrypoints.server import build_app

    monkeypatch.delenv("POLYINF_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-test-123")
    eng = LLMEngine(EngineConfig(source=resolve(str(_write_model(tmp_path))), num_kv_blocks=8, load_tokenizer=False))
    aengine = AsyncEngine(eng)
    try:
        client = TestClient(build_app(aengine, "tiny"))
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-123"}):
            r = client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "sk-test-123" not in r.text
        assert client.get("/v1/models").status_code == 401
        r = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-test-123"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    finally:
        aengine.shutdown()
