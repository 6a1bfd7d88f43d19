"""Serving parallel layouts on CPU (gloo): a tensor-parallel group (-tp 2, one process per rank) and data-parallel
replicas behind the router (-dp 2) answer as one engine does; swaps and rollbacks reach every rank and replica;
a killed replica fails its requests cleanly while the router serves on and starts it again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader.model_source import resolve
from engine.entrypoints.router import conversation_key, merged_metrics
from ops.release.deploy import free_port

pytestmark = pytest.mark.slow
TOKEN = "layout-admin-token"
PROMPTS = [[1, 5, 9, 13, 2, 7, 33], [4, 4, 8], list(range(10, 31))]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 4096}
    (d / "config.json").write_text(json.dumps(cfg))
    return d / "config.json"


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """Greedy tokens of PROMPTS from one engine in this process."""
    eng = LLMEngine(EngineConfig(source=resolve(str(model), synthetic=True), num_kv_blocks=256, load_tokenizer=False))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]


def _serve(model: Path, *flags: str):
    port = free_port()
    env = {**os.environ, "POLYINF_ADMIN_TOKEN": TOKEN, "OPENAI_API_KEY": "sk-must-not-reach-ranks"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--model", str(model), "--synthetic",
                             "--num-kv-blocks", "256", "--port", str(port), *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _greedy(url: str, model: Path) -> list[list[int]]:
    """PROMPTS sent at once (so they batch); each answer's token ids."""
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": str(model), "prompt": PROMPTS[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        out[i] = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out[i] for i in range(len(PROMPTS))]


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids] + [g for k in kids for g in _children(int(k))]


def _no_secret_in(pids: list[int]) -> None:
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(e.startswith((b"OPENAI_API_KEY=", b"POLYINF_ADMIN_TOKEN=")) for e in env), pid


def _admin(url: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"})


def _with(active: dict, **change) -> dict:
    spec = {**active, **change}
    spec.pop("variant_id")
    return spec


def test_tp2_serves_as_one_engine_and_swaps_on_every_rank(model, reference):
    proc, url = _serve(model, "-tp", "2")
    try:
        _no_secret_in(_children(proc.pid))
        assert _greedy(url, model) == reference
        got = _admin(url, "GET", "/admin/variant").json()
        start = got["active"]
        assert start["tp"] == 2 and got["ranks"] == [start["variant_id"]] * 2
        r = _admin(url, "POST", "/admin/variant", _with(start, weight_dtype="int8", max_num_seqs=8))
        assert r.status_code == 200, r.text
        int8 = r.json()["variant_id"]
        assert _admin(url, "GET", "/admin/variant").json()["ranks"] == [int8, int8]
        assert all(len(t) == 6 for t in _greedy(url, model))  # int8 on both ranks: they still agree step by step
        bad = _with(start, kernels={"silu_and_mul": "generated:m.f"}, generated_source={"m": "import os\n"})
        r = _admin(url, "POST", "/admin/variant", bad)
        assert r.status_code == 422 and "rank 0" in r.text and "rank 1" in r.text
        assert _admin(url, "GET", "/admin/variant").json()["ranks"] == [int8, int8]  # nothing switched
        assert _admin(url, "POST", "/admin/rollback").status_code == 200
        assert _admin(url, "GET", "/admin/variant").json()["ranks"] == [start["variant_id"]] * 2
        assert _greedy(url, model) == reference
    finally:
        _stop(proc)
    assert proc.wait(timeout=30) is not None


def test_dp2_router_balances_swaps_and_survives_a_killed_replica(model, reference):
    proc, url = _serve(model, "-dp", "2")
    try:
        _no_secret_in(_children(proc.pid))
        assert _greedy(url, model) == reference
        health = httpx.get(url + "/health").json()
        assert [r["up"] for r in health["replicas"]] == [True, True]
        assert sum(r["served"] for r in health["replicas"]) == len(PROMPTS)
        # a conversation's requests stay on the replica holding its prefix
        for _ in range(3):
            httpx.post(url + "/v1/completions", timeout=60, json={"model": str(model), "prompt": PROMPTS[2] + [5],
                                                                  "max_tokens": 2, "temperature": 0})
        after = httpx.get(url + "/health").json()["replicas"]
        grew = [a["served"] - b["served"] for a, b in zip(after, health["replicas"])]
        assert sorted(grew) == [0, 3]
        metrics = httpx.get(url + "/metrics").text
        assert 'polyinf:replica_up{replica="1"} 1.0' in metrics and 'replica="0"' in metrics
        # swap and rollback across replicas; a variant only one could take is rolled back on the other
        active = _admin(url, "GET", "/admin/variant").json()
        assert active["active"]["dp"] == 2 and len({r["variant_id"] for r in active["replicas"]}) == 1
        r = _admin(url, "POST", "/admin/variant", _with(active["active"], max_num_seqs=8))
        assert r.status_code == 200 and r.json()["replicas"] == 2
        ids = {x["variant_id"] for x in _admin(url, "GET", "/admin/variant").json()["replicas"]}
        assert len(ids) == 1 and ids != {active["replicas"][0]["variant_id"]}
        r = _admin(url, "POST", "/admin/variant", _with(active["active"], dp=3))
        assert r.status_code == 422 and "needs a restart" in r.text
        assert _admin(url, "POST", "/admin/rollback").status_code == 200
        assert _admin(url, "GET", "/admin/variant").json()["active"] == active["active"]

        # kill a replica while both stream: its stream ends with an error event, the other finishes
        results: dict[int, tuple] = {}
        streamed = [0, 0]

        def stream(i: int) -> None:
            n, err = 0, None
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "model": str(model), "prompt": [i + 40, 2, 3], "max_tokens": 3000, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as resp:
                if resp.status_code != 200:  # failed before its stream began: a JSON error body
                    err = json.loads(resp.read())["error"]
                for line in resp.iter_lines() if err is None else ():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        if "error" in d:
                            err = d["error"]
                            break
                        n += 1
                        streamed[i] = n
            results[i] = (n, err)
        # both replicas up first (a replica the router marked down under load comes back by its health check),
        # so the router spreads the two streams; the victim is a replica serving one of them, whichever it is
        deadline = time.time() + 60
        while not all(r["up"] for r in httpx.get(url + "/health").json()["replicas"]):
            assert time.time() < deadline
            time.sleep(0.2)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while True:
            reps = httpx.get(url + "/health").json()["replicas"]
            if sum(r["in_flight"] for r in reps) >= 2 and min(streamed) > 0:  # both mid-stream
                break
            assert time.time() < deadline
            time.sleep(0.05)
        victim = max(reps, key=lambda r: r["in_flight"])
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join()
        assert len(results) == 2, results
        errors = [err for _, err in results.values() if err is not None]
        assert len(errors) == victim["in_flight"], (victim, results)
        assert all(e["code"] == "replica_failed" and f"replica {victim['replica']}" in e["message"] for e in errors)
        assert all(n == 3000 for n, err in results.values() if err is None)
        for _ in range(3):  # served on: by the other replica, then by the restarted one
            assert _greedy(url, model) == reference
        deadline = time.time() + 120
        while True:
            rep = httpx.get(url + "/health").json()["replicas"][victim["replica"]]
            if rep["up"] and rep["restarts"] == 1:
                break
            assert time.time() < deadline, rep
            time.sleep(0.5)
        assert rep["pid"] != victim["pid"]
    finally:
        _stop(proc)


def test_conversation_keys_and_merged_metrics():
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    later = {"messages": [*chat["messages"], {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "more"}]}
    assert conversation_key("/v1/chat/completions", chat) == conversation_key("/v1/chat/completions", later)
    other = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]}
    assert conversation_key("/v1/chat/completions", chat) != conversation_key("/v1/chat/completions", other)
    ids = list(range(300))
    assert conversation_key("/v1/completions", {"prompt": ids}) == conversation_key("/v1/completions",
                                                                                   {"prompt": ids + [7]})
    assert conversation_key("/v1/completions", {"prompt": 5}) is None
    text = ('# HELP vllm:prompt_tokens_total Prompt tokens.\n# TYPE vllm:prompt_tokens_total counter\n'
            'vllm:prompt_tokens_total{model_name="m"} 3.0\n')
    out = merged_metrics({0: text, 1: text.replace("3.0", "4.0")})
    (fam,) = out.collect()
    assert sorted((s.labels["replica"], s.value) for s in fam.samples if s.name.endswith("_total")) == [
        ("0", 3.0), ("1", 4.0)]
