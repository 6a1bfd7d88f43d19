"""The real server on a loopback port, driven by the real openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from ops.release.deploy import free_port
import pytest

from engine import SamplingParams
from engine.serving.capture import read_capture_dir

TOKEN = "test-admin-token"
SHARED = Path(__file__).resolve().parents[2] / "traces"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cap = tmp_path_factory.mktemp("capture")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "serve", "--model", "smollm2", "--port", str(port),
         "--capture-dir", str(cap), "--admin-token", TOKEN, "--num-kv-blocks", "1024", "--max-num-seqs", "32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield {"url": url, "capture": cap, "proc": proc}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _captured(server) -> int:
    return len(read_capture_dir(server["capture"]))


def test_models_completion_chat_and_streaming_match_the_engine(server, client, smollm2_engine_factory):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    eng = smollm2_engine_factory(num_kv_blocks=64)
    offline = eng.generate(["The capital of France is"], SamplingParams(max_tokens=12))[0]
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    assert c.choices[0].text == offline.text and c.usage.completion_tokens == len(offline.token_ids)
    chat_offline = eng.generate(["What is the capital of France?"], SamplingParams(max_tokens=24), chat=True)[0]
    chat = client.chat.completions.create(model="smollm2", max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.choices[0].message.content == chat_offline.text == "The capital of France is Paris."
    assert chat.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", max_tokens=24, temperature=0, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}])]
    assert "".join(pieces) == chat_offline.text and len([p for p in pieces if p]) > 3
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert streamed == offline.text
    raw = httpx.post(server["url"] + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3,
                                                              "stream": True}, timeout=60).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_what_openai_clients_send(server, client, smollm2_engine_factory):
    """Fields ordinary clients send (LangChain's zero penalties, ``user``, fields the server does not know) are
    accepted; n, logprobs (plain and streamed), penalties, logit_bias, content parts, the chat's default length and
    /tokenize work."""
    url, question = server["url"], "What is the capital of France?"
    plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                           max_tokens=12, temperature=0)
    # what LangChain's ChatOpenAI sends, and fields no version of this server knows, in the body and a message
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": [{"role": "user", "content": question, "frobnicate": 1}], "max_tokens": 12,
        "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "n": 1, "logit_bias": {}, "user": "u",
        "metadata": {"k": "v"}, "frobnicate": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain.choices[0].message.content
    # content parts joined; the default length is the rest of the context (the answer ends on its own)
    parts = client.chat.completions.create(model="smollm2", temperature=0, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}])
    assert parts.choices[0].message.content == "The capital of France is Paris." == plain.choices[0].message.content
    longer = client.chat.completions.create(model="smollm2", temperature=0, messages=[
        {"role": "user", "content": "Explain in two sentences what a CPU does."}])
    assert longer.choices[0].finish_reason == "stop" and longer.usage.completion_tokens > 16
    # n choices, each its own draw (seed + i), usage summed
    many = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                     seed=7, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2] and len({c.text for c in many.choices}) >= 2
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens == 4
    # the same n choices streamed: each index's chunks join to that choice's text (the same seeds), usage summed
    texts, usage = {}, None
    for chunk in client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                           seed=7, n=3, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in many.choices} and usage.completion_tokens == 24
    # a logit bias of 100 decides every token; penalties change what greedy decoding repeats
    tok = httpx.post(url + "/tokenize", json={"model": "smollm2", "prompt": " Paris"}).json()["tokens"][-1]
    biased = client.completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(tok): 100})
    assert biased.choices[0].text == " Paris" * 4
    prompt = "one two one two one two one two"
    same = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    penalised = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"repetition_penalty": 3.0}, frequency_penalty=2.0)
    assert same.choices[0].text != penalised.choices[0].text
    # logprobs: the chosen tokens' log-probabilities under the model, against the engine's own logits
    eng = smollm2_engine_factory(num_kv_blocks=64)
    seen = []
    eng.logits_sink = lambda ids, logits: seen.append(logits.float().clone())
    offline = eng.generate(["The capital of France is"], SamplingParams(max_tokens=3))[0]
    eng.logits_sink = None
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text == offline.text and len(lp.top_logprobs) == 3
    for step, (chosen, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        ref = torch.log_softmax(seen[step][0].double(), -1)
        assert abs(chosen - ref[offline.token_ids[step]].item()) < 1e-4
        assert len(top) == 2 and abs(max(top.values()) - chosen) < 1e-6  # greedy: the chosen token is the top one
    ch = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    content = ch.choices[0].logprobs.content
    assert "".join(e.token for e in content).startswith(ch.choices[0].message.content)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    # streamed, each chunk carries its new tokens' log-probabilities: together, the same entries
    streamed = [e for chunk in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=2, stream=True) for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    sc = [chunk for chunk in client.completions.create(model="smollm2", prompt="The capital of France is",
                                                       max_tokens=3, temperature=0, logprobs=2, stream=True)]
    assert [t for chunk in sc for c in chunk.choices if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    # /tokenize and /detokenize (vLLM's); a chat's tokens are what the chat completion counts
    toks = httpx.post(url + "/tokenize", json={"prompt": "The capital of France"}).json()
    assert httpx.post(url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "The capital of France"
    counted = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": question}]}).json()
    assert counted["count"] == plain.usage.prompt_tokens and counted["max_model_len"] > 0
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    # /metrics as vLLM's dashboard reads it: every series labelled with the served model's name; preemptions;
    # the active variant as an info series
    samples = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all('model_name="smollm2"' in ln for ln in samples)
    assert any(ln.startswith("vllm:num_preemptions_total{") for ln in samples)
    active = httpx.get(url + "/admin/variant", headers={"Authorization": f"Bearer {TOKEN}"}).json()["active"]
    assert any(ln.startswith("polyinf:active_variant_info{") and f'variant_id="{active["variant_id"]}"' in ln
               and ln.endswith(" 1.0") for ln in samples)


def test_langchain_chat_openai_in_a_chain(server, monkeypatch):
    """LangChain's ChatOpenAI (the fields it sends, its parsing of the reply) in a prompt | model | parser chain,
    plain and streamed."""
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server["url"] + "/v1", api_key="none", model="smollm2", temperature=0, max_tokens=24,
                     max_retries=0, timeout=120)
    chain = ChatPromptTemplate.from_messages([("user", "What is the capital of {country}?")]) | llm | StrOutputParser()
    assert chain.invoke({"country": "France"}) == "The capital of France is Paris."
    assert "".join(chain.stream({"country": "France"})) == "The capital of France is Paris."
    reply = llm.invoke("What is the capital of France?")
    assert reply.response_metadata["finish_reason"] == "stop" and reply.usage_metadata["output_tokens"] > 0


def test_structured_output_through_openai_and_langchain(server, client, monkeypatch):
    """response_format json_schema as the openai client sends it (streamed too) and as LangChain's
    ``with_structured_output(method="json_schema")`` sends and parses it; json_object."""
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    import jsonschema
    from langchain_openai import ChatOpenAI

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0,
                                       response_format=fmt)
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris" and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=40, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert json.loads(streamed) == answer
    obj = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    llm = ChatOpenAI(base_url=server["url"] + "/v1", api_key="none", model="smollm2", temperature=0, max_tokens=40,
                     max_retries=0, timeout=120)
    place = llm.with_structured_output({"title": "place", **schema}, method="json_schema").invoke(
        "What is the capital of France?")
    assert place == answer


def _err(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_bad_requests_get_openai_errors_and_nothing_is_captured(server):
    url = server["url"]
    before = _captured(server)
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in _err(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert r.status_code == 404 and _err(r)["code"] == "model_not_found"
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and "max_tokens" in _err(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 10**9})
    assert r.status_code == 400 and "context" in _err(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "word " * 9000, "max_tokens": 4})
    assert r.status_code == 400 and _err(r)["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "smollm2", "messages": [{"role": "robot",
                                                                                         "content": "x"}]})
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "temperature": -2})
    assert r.status_code == 400 and "temperature" in _err(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "seed": 2**64})
    assert r.status_code == 400 and "seed" in _err(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "echo": True})
    assert r.status_code == 400 and _err(r)["param"] == "echo"
    for bad in ({"n": 0}, {"n": 17}, {"logprobs": 21},
                {"presence_penalty": 3}, {"repetition_penalty": 0}, {"logit_bias": {"x": 1}},
                {"logit_bias": {"5": 101}}, {"logit_bias": {str(10**9): 1}}):
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", **bad})
        assert r.status_code == 400, bad
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    for bad in ({"response_format": {"type": "regex"}}, {"response_format": {"type": "json_schema"}},
                {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
                {"response_format": "json"}, {"top_logprobs": 2},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, **bad})
        assert r.status_code == 400 and _err(r)["param"] in ("response_format", "top_logprobs", "messages"), bad
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "stop": ""})
    assert r.status_code == 400 and "stop" in _err(r)["message"]
    for empty in ("", []):
        r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": empty})
        assert r.status_code == 400, empty
    r = httpx.post(url + "/v1/chat/completions", json={"model": "smollm2", "messages": []})
    assert r.status_code == 400 and _err(r)["param"] == "messages"
    r = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": [1, 2, 10**9]})
    assert r.status_code == 400
    assert _captured(server) == before
    # a temperature so small that logits / temperature overflow samples the argmax, and the server goes on
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6}
    tiny = httpx.post(url + "/v1/completions", json={**body, "temperature": 1e-40, "seed": 3}, timeout=60)
    greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60)
    assert tiny.status_code == greedy.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert _captured(server) == before + 2
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_client_disconnect_mid_stream_is_not_captured(server, client):
    before = _captured(server)
    with httpx.stream("POST", server["url"] + "/v1/completions", timeout=60,
                      json={"model": "smollm2", "prompt": "Count to one hundred:", "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up
    deadline = time.time() + 30
    while time.time() < deadline and _metric(server["url"], "vllm:num_requests_running") > 0:
        time.sleep(0.3)
    assert _metric(server["url"], "vllm:num_requests_running") == 0  # the engine stopped working on it
    c = client.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
    assert c.choices[0].text
    assert _captured(server) == before + 1  # only the finished request


def test_client_gone_before_a_whole_response_is_aborted_and_not_captured(server, client):
    """A client that stops waiting for a non-streamed response: the engine stops working on its request."""
    before = _captured(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + "/v1/completions", timeout=1.5,
                   json={"model": "smollm2", "prompt": "Count to one thousand:", "max_tokens": 2000,
                         "ignore_eos": True})
    deadline = time.time() + 30
    while time.time() < deadline and _metric(server["url"], "vllm:num_requests_running") > 0:
        time.sleep(0.3)
    assert _metric(server["url"], "vllm:num_requests_running") == 0
    assert client.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    assert _captured(server) == before + 1


def test_bounded_load_every_request_answered_and_captured_once(server):
    from openai import AsyncOpenAI

    before = _captured(server)
    before_ok = _metric(server["url"], "vllm:request_success_total")

    async def run():
        client = AsyncOpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
        sem = asyncio.Semaphore(32)

        async def one(i):
            async with sem:
                r = await client.completions.create(model="smollm2", prompt=f"Request {i}: the number after {i} is",
                                                    max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
                return r.usage.completion_tokens

        out = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=600)
        await client.close()
        return out

    tokens = asyncio.run(run())
    assert tokens == [4] * 200
    assert _captured(server) == before + 200
    assert _metric(server["url"], "vllm:request_success_total") == before_ok + 200


@pytest.mark.slow
@pytest.mark.parametrize("trace", ["AzureLLMInferenceTrace_conv.csv", "mooncake_conversation_trace.jsonl"])
def test_replay_report_agrees_with_server_metrics(server, trace, tmp_path):
    count = 40  # requests replayed
    url = server["url"]
    names = ["vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]
    before = {n: _metric(url, n) for n in names}
    out = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "replay", "--trace", str(SHARED / trace),
                        "--base-url", url + "/v1", "--model", "smollm2", "--tokenizer", "smollm2",
                        "--max-requests", str(count), "--time-scale", "0.001", "--max-input", "48", "--max-output", "4",
                        "--slo-ttft-ms", "60000", "--goodput", "tpot:60000", "e2el:600000", "--json", str(out),
                        "--save-result", str(tmp_path / "vllm.json"), "--percentile-metrics", "ttft,tpot,itl,e2el",
                        "--metric-percentiles", "90,99"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "TTFT ms" in r.stdout and "goodput" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["completed"] == count and rep["failed"] == 0
    after = {n: _metric(url, n) for n in names}
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == count
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == rep["total_input_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == rep["total_output_tokens"]
    assert rep["goodput"] == pytest.approx(rep["request_throughput"])  # generous SLOs: every request is good
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert rep[key]["p50"] <= rep[key]["p90"] <= rep[key]["p99"]
    # the same replay in `vllm bench serve --save-result`'s keys and units, as existing notebooks read it
    res = json.loads((tmp_path / "vllm.json").read_text())
    assert res["completed"] == count and res["total_output_tokens"] == rep["total_output_tokens"]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert len(res["ttfts"]) == len(res["itls"]) == len(res["generated_texts"]) == count
    assert sum(res["output_lens"]) == res["total_output_tokens"] and all(res["generated_texts"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"median_{m}_ms"] <= res[f"p90_{m}_ms"] <= res[f"p99_{m}_ms"] and res[f"std_{m}_ms"] >= 0
    assert res["median_ttft_ms"] == pytest.approx(1e3 * sorted(res["ttfts"])[count // 2], rel=0.5)  # seconds -> ms
    assert res["mean_ttft_ms"] == pytest.approx(rep["ttft_ms"]["mean"])
    bad = subprocess.run([sys.executable, "-m", "pipelines.cli", "replay", "--trace", str(SHARED / trace), "--base-url",
                          url + "/v1", "--model", "smollm2", "--goodput", "ttft=5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--goodput takes KEY:MILLISECONDS" in bad.stderr


def test_admin_endpoints_need_the_token(server):
    url = server["url"]
    assert httpx.get(url + "/admin/variant").status_code == 401
    assert httpx.get(url + "/admin/variant", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/admin/rollback", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    active = httpx.get(url + "/admin/variant", headers=auth).json()["active"]
    spec = {**active, "max_num_seqs": 8}
    spec.pop("variant_id")
    r = httpx.post(url + "/admin/variant", headers=auth, json=spec, timeout=60)
    assert r.status_code == 200 and r.json()["scopes"] == ["scheduler"]
    assert httpx.get(url + "/admin/variant", headers=auth).json()["active"]["max_num_seqs"] == 8
    bad = {**spec, "kernels": {"silu_and_mul": "generated:m.f"}, "generated_source": {"m": "import os\n"}}
    r = httpx.post(url + "/admin/variant", headers=auth, json=bad, timeout=60)
    assert r.status_code == 422 and "previous variant stays active" in _err(r)["message"]
    r = httpx.post(url + "/admin/rollback", headers=auth, timeout=60)
    assert r.status_code == 200
    assert httpx.get(url + "/admin/variant", headers=auth).json()["active"]["variant_id"] == active["variant_id"]


def test_capture_survives_kill_and_restart(tmp_path):
    """SIGKILL loses no finished request; a restarted server appends to the same capture."""
    tiny = Path(__file__).parent / "tiny_moe"

    def start():
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--model", str(tiny), "--synthetic",
                                 "--port", str(port), "--capture-dir", str(tmp_path), "--capture-prompts"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.25)
        proc.kill()
        raise RuntimeError("server did not come up")

    def send(url, n):
        for i in range(n):
            r = httpx.post(url + "/v1/completions", json={"model": str(tiny), "prompt": [1, 2, 3, i + 4],
                                                          "max_tokens": 3, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text

    proc, url = start()
    send(url, 5)
    proc.kill()  # SIGKILL: no shutdown hooks run
    proc.wait()
    assert len(read_capture_dir(tmp_path)) == 5
    proc, url = start()
    try:
        send(url, 3)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    recs = read_capture_dir(tmp_path)
    assert len(recs) == 8 and all(r.input_tokens == 4 and r.output_tokens == 3 for r in recs)
    assert all(r.ttft_s is not None and r.e2e_s >= r.ttft_s for r in recs)


def test_tokenizer_less_server_streams_token_ids_and_replay_times_them(tmp_path):
    """A model without a tokenizer streams each new token's id; replay measures TTFT and ITL from them."""
    from engine.serving.trace_record import TraceRecord
    from ops.release.deploy import ServerProcess
    from ops.traffic.replay import replay_async

    tiny = Path(__file__).parent / "tiny_moe"
    server = ServerProcess(["--model", str(tiny), "--synthetic"], str(tiny))
    url = server.url
    try:
        ids = []
        with httpx.stream("POST", url + "/v1/completions", json={"model": str(tiny), "prompt": [1, 2, 3],
                          "max_tokens": 5, "ignore_eos": True, "stream": True,
                          "temperature": 0}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
        assert ids == _offline_tokens(tiny, [1, 2, 3], 5)
        recs = [TraceRecord(arrival_s=0.01 * i, input_tokens=4 + i, output_tokens=6, source="t") for i in range(4)]
        rep = asyncio.run(replay_async(recs, [[5 + i] * (4 + i) for i in range(4)], url + "/v1", str(tiny)))
        assert rep.completed == 4 and rep.total_output_tokens == 24
        assert rep.ttft_ms["p50"] > 0 and rep.itl_ms["p50"] > 0 and rep.e2e_ms["p50"] >= rep.ttft_ms["p50"]
    finally:
        server.stop()


def _offline_tokens(model_dir, prompt, n):
    from engine import EngineConfig, LLMEngine, resolve
    from engine.config.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(source=resolve(str(model_dir), synthetic=True), load_tokenizer=False))
    rid = eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                out = o.token_ids
    return out


def test_speculation_swapped_in_shows_in_metrics_and_rolls_back(server, client):
    url, auth = server["url"], {"Authorization": f"Bearer {TOKEN}"}
    active = httpx.get(url + "/admin/variant", headers=auth).json()["active"]
    spec = {**active, "speculative_tokens": 4}
    spec.pop("variant_id")
    r = httpx.post(url + "/admin/variant", headers=auth, json=spec, timeout=60)
    assert r.status_code == 200 and r.json()["scopes"] == ["scheduler"]
    before = _metric(url, "vllm:spec_decode_num_drafts_total")
    text = "the cat sat on the mat, " * 6
    out = client.completions.create(model="smollm2", prompt="Repeat: " + text + "\nAgain: " + text[:40],
                                    max_tokens=24, temperature=0)
    assert out.usage.completion_tokens >= 1
    drafts = _metric(url, "vllm:spec_decode_num_drafts_total") - before
    drafted = _metric(url, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(url, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafted
    assert _metric(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    r = httpx.post(url + "/admin/rollback", headers=auth, timeout=60)
    assert r.status_code == 200
    assert httpx.get(url + "/admin/variant", headers=auth).json()["active"]["speculative_tokens"] == 0
