"""The workload endpoint, a real uvicorn server on a free loopback port: outputs equal the eager module's bit for bit,
requests batched together each get their own output, hot swaps and rollback through /admin, every bad input a 4xx
JSON error with the server still up; and ``polyinf serve-workload`` as a process."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from engine.entrypoints.workload_server import build_workload_app
from engine.workloads import WorkloadVariant, build_runner, get_workload
from ops.release.deploy import free_port

TOKEN = "test-workload-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
BODY_LIMIT = 1024**2  # small, so a 413 costs little
MAX_QUEUE = 4


def _start(app) -> tuple[str, object, threading.Thread]:
    """``app`` under uvicorn in a thread on a free loopback port (another port if one was taken meanwhile)."""
    import uvicorn

    for _ in range(5):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 30
        while not server.started and thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        if server.started:
            return f"http://127.0.0.1:{port}", server, thread
        server.should_exit = True
        thread.join(timeout=5)
    raise RuntimeError("the workload server did not start")


def _stop(server, thread) -> None:
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def served():
    workload = get_workload("patchtst")
    module = workload.build("cpu")
    runner = build_runner(workload, WorkloadVariant(name="eager"), module, "cpu")
    app = build_workload_app(runner, admin_token=TOKEN, max_queue=MAX_QUEUE, max_body_bytes=BODY_LIMIT)
    url, server, thread = _start(app)
    yield {"url": url, "app": app, "runner": runner, "module": module, "workload": workload}
    _stop(server, thread)


def _explicit(request, with_size: bool = False) -> dict:
    inputs = {k: {"shape": list(v.shape), "data": v.flatten().tolist()} for k, v in request.tensors.items()}
    return {"inputs": inputs, **({"size": request.size} if with_size else {})}


def _reference(workload, module, request) -> torch.Tensor:
    """The eager module on this one request alone."""
    with torch.inference_mode():
        return workload.split(module(**workload.collate([request.tensors])), [request.tensors])[0]


def _output(answer: dict) -> torch.Tensor:
    out = answer["outputs"]
    return torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


def _infer(url: str, body, name: str = "patchtst", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{url}/v1/workloads/{name}/infer", content=body, timeout=60,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(f"{url}/v1/workloads/{name}/infer", json=body, timeout=60, **kw)


def test_explicit_and_generated_requests_equal_the_eager_module_bit_for_bit(served):
    url, w, module = served["url"], served["workload"], served["module"]
    for i, req in enumerate(w.make_inputs([1, 3], seed=11)):
        r = _infer(url, _explicit(req, with_size=i == 1))
        assert r.status_code == 200, r.text
        ans = r.json()
        assert ans["workload"] == "patchtst" and ans["id"].startswith("wl-") and ans["latency_ms"] > 0
        assert ans["variant_id"] == served["runner"].variant.variant_id
        assert ans["outputs"]["shape"] == [req.size, 96]
        assert torch.equal(_output(ans), _reference(w, module, req))
    r = _infer(url, {"size": 3, "seed": 5})
    assert r.status_code == 200, r.text
    assert torch.equal(_output(r.json()), _reference(w, module, w.make_inputs([3], seed=5)[0]))


def test_listing_health_and_metrics(served):
    url = served["url"]
    d = httpx.get(url + "/v1/workloads?size=3").json()["data"][0]
    assert d["name"] == "patchtst" and d["inputs"] == {"series": {"shape": [3, 336], "dtype": "float32"}}
    assert d["min_size"] == 1 and d["max_size"] == 512 and d["batch_policy"]["grouping"] == "concat"
    assert httpx.get(url + "/v1/workloads?size=0").status_code == 400
    assert httpx.get(url + "/health").json()["status"] == "ok"
    _infer(url, {"size": 1, "seed": 1})
    _infer(url, {"size": 0, "seed": 1})
    text = httpx.get(url + "/metrics").text
    assert 'polyinf_workload_requests_total{status="200",workload="patchtst"}' in text
    assert 'polyinf_workload_requests_total{status="400",workload="patchtst"}' in text
    assert "polyinf_workload_request_latency_seconds_count" in text and "polyinf_workload_batch_size" in text


def test_requests_queued_together_share_a_pass_and_each_get_their_own_output_and_a_full_queue_is_503(served):
    """The worker is held inside its first forward pass; four requests queue behind it (the limit), a fifth gets a
    503; released, the four run as one batch and each answer equals its request's own reference."""
    url, w, module, runner = served["url"], served["workload"], served["module"], served["runner"]
    entered, release = threading.Event(), threading.Event()
    real = runner.forward

    def held(**inputs):
        entered.set()
        release.wait(30)
        return real(**inputs)

    reqs = w.make_inputs([1, 2, 1, 3, 2], seed=21)
    runner.forward = held
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            first = pool.submit(_infer, url, _explicit(reqs[0]))
            assert entered.wait(30)
            rest = [pool.submit(_infer, url, _explicit(r)) for r in reqs[1:]]
            deadline = time.time() + 30
            while served["app"].state.batcher.queued < MAX_QUEUE and time.time() < deadline:
                time.sleep(0.01)
            full = _infer(url, {"size": 1, "seed": 3})
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
            release.set()
            answers = [f.result().json() for f in [first, *rest]]
    finally:
        release.set()
        runner.forward = real
    assert [a["batch_size"] for a in answers] == [1, 4, 4, 4, 4]
    for req, ans in zip(reqs, answers):
        assert torch.equal(_output(ans), _reference(w, module, req))
    assert _infer(url, {"size": 1, "seed": 3}).status_code == 200


def test_hot_swap_changes_the_variant_not_the_module_and_rolls_back(served):
    url, w, module, runner = served["url"], served["workload"], served["module"], served["runner"]
    pointers = [p.data_ptr() for p in module.parameters()]
    before = httpx.get(url + "/admin/variant", headers=ADMIN).json()["active"]
    swapped = WorkloadVariant(name="batch-2", max_batch=2)
    r = httpx.post(url + "/admin/variant", headers=ADMIN, json=swapped.to_json())
    assert r.status_code == 200, r.text
    assert r.json()["active"]["variant_id"] == swapped.variant_id != before["variant_id"]
    assert r.json()["previous"]["variant_id"] == before["variant_id"]
    req = w.make_inputs([2], seed=31)[0]
    ans = _infer(url, _explicit(req)).json()
    assert ans["variant_id"] == swapped.variant_id and torch.equal(_output(ans), _reference(w, module, req))
    assert runner.module is module and [p.data_ptr() for p in module.parameters()] == pointers

    # a precision change is accepted only with the tolerance gate acknowledged
    bf16 = {"name": "bf16", "matmul_precision": "bf16"}
    r = httpx.post(url + "/admin/variant", headers=ADMIN, json=bf16)
    assert r.status_code == 400 and r.json()["error"]["code"] == "tolerance_gate_required"
    assert '"gate": "tolerance"' in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/variant", headers=ADMIN, json={**bf16, "gate": "tolerance"})
    assert r.status_code == 200 and r.json()["gate"] == "tolerance"
    bf16_id = r.json()["active"]["variant_id"]
    assert _infer(url, {"size": 1, "seed": 2}).json()["variant_id"] == bf16_id

    # refused for the device, or invalid: a 400 that says why, the active variant stays
    for body, code in [({"cuda_graphs": True}, "variant_refused"), ({"max_batch": 0}, "invalid_variant"),
                       ({"frobnicate": 1}, "invalid_variant"), ({"cuda_graphs": "yes"}, "invalid_variant"),
                       ({"max_batch": 2, "variant_id": "0" * 16}, "invalid_variant"), ([1], "invalid_variant")]:
        r = httpx.post(url + "/admin/variant", headers=ADMIN, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
    assert "CUDA" in httpx.post(url + "/admin/variant", headers=ADMIN, json={"cuda_graphs": True}).text
    r = httpx.post(url + "/admin/variant", headers={**ADMIN, "content-type": "application/json"}, content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(url + "/admin/variant", headers=ADMIN).json()["active"]["variant_id"] == bf16_id

    for expected in (swapped.variant_id, before["variant_id"]):
        r = httpx.post(url + "/admin/rollback", headers=ADMIN)
        assert r.status_code == 200 and r.json()["active"]["variant_id"] == expected
    assert _infer(url, {"size": 1, "seed": 2}).json()["variant_id"] == before["variant_id"]
    r = httpx.post(url + "/admin/rollback", headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollback_refused"
    assert runner.module is module


def _series(shape, data=None) -> dict:
    n = 1
    for d in shape:
        n *= d
    return {"inputs": {"series": {"shape": shape, "data": [0.5] * n if data is None else data}}}


SECRET = "s3cr3t-" + "x" * 5000
BAD = [  # (body, workload in the path, status, error code)
    (b'{"size": 1,', "patchtst", 400, "invalid_json"),
    (b"\xff\xfe", "patchtst", 400, "invalid_json"),
    (b'{"size": 1, "seed": NaN}', "patchtst", 400, "non_finite"),
    ({"size": 1, "seed": 1}, "fno", 404, "workload_not_found"),
    ({"size": 1, "seed": 1}, SECRET[:200], 404, "workload_not_found"),
    ({"inputs": {"x": {"shape": [1, 336], "data": [0.0] * 336}}}, "patchtst", 400, "bad_input_names"),
    ({"inputs": {SECRET: {"shape": [1, 336], "data": [0.0] * 336}}}, "patchtst", 400, "bad_input_names"),
    (_series([1, 335]), "patchtst", 400, "bad_shape"),
    (_series([1, 336, 1]), "patchtst", 400, "bad_shape"),
    (_series([1, 336], [0.0] * 335), "patchtst", 400, "data_length_mismatch"),
    (_series([1, 336], [1e39] + [0.0] * 335), "patchtst", 400, "non_finite"),
    (b'{"inputs": {"series": {"shape": [1, 336], "data": [1e999' + b", 0" * 335 + b"]}}}", "patchtst", 400,
     "non_finite"),
    (b'{"inputs": {"series": {"shape": [1, 336], "data": [Infinity' + b", 0" * 335 + b"]}}}", "patchtst", 400,
     "non_finite"),
    (_series([1, 336], [SECRET] + [0.0] * 335), "patchtst", 400, "not_a_number"),
    (_series([1, 336], [True] + [0.0] * 335), "patchtst", 400, "not_a_number"),
    (_series([0, 336]), "patchtst", 400, "size_out_of_range"),
    ({**_series([2, 336]), "size": 3}, "patchtst", 400, "bad_shape"),
    ({"size": 0, "seed": 1}, "patchtst", 400, "size_out_of_range"),
    ({"size": 513, "seed": 1}, "patchtst", 400, "size_out_of_range"),
    ({"size": True, "seed": 1}, "patchtst", 400, None),
    ({"size": 1, "seed": -1}, "patchtst", 400, "seed_out_of_range"),
    ({"seed": 1}, "patchtst", 400, None),
    ({"size": 1}, "patchtst", 400, None),
    ({**_series([1, 336]), "seed": 1}, "patchtst", 400, None),
    ({"size": 1, "seed": 1, SECRET: 1}, "patchtst", 400, "unknown_field"),
    ([1, 2], "patchtst", 400, None),
    (b'{"size": 1, "seed": 1, "pad": "' + b"x" * (BODY_LIMIT + 10) + b'"}', "patchtst", 413, "body_too_large"),
]


def test_every_bad_input_gets_a_4xx_json_error_and_the_server_stays_up(served):
    url = served["url"]
    for body, name, status, code in BAD:
        r = _infer(url, body, name=name)
        assert r.status_code == status, (str(body)[:80], r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert code is None or err["code"] == code, (str(body)[:80], err)
        assert len(r.text) < 1000 and "s3cr3t" not in r.text and TOKEN not in r.text, r.text[:300]
    assert httpx.get(url + "/health").status_code == 200
    assert _infer(url, {"size": 1, "seed": 1}).status_code == 200


def test_admin_needs_the_token(served):
    url = served["url"]
    for method, path in [("GET", "/admin/variant"), ("POST", "/admin/variant"), ("POST", "/admin/rollback")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            r = httpx.request(method, url + path, headers=headers, json={"max_batch": 2})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
            assert TOKEN not in r.text
    assert httpx.get(url + "/admin/variant", headers=ADMIN).status_code == 200


def test_protein_inputs_derive_the_graph_and_check_residue_types():
    """Integer inputs in range, the radius graph computed by the server (a client's graph is refused)."""
    w = get_workload("protein_e3nn")
    module = w.build("cpu")
    app = build_workload_app(build_runner(w, WorkloadVariant(), module, "cpu"), admin_token=TOKEN)
    url, server, thread = _start(app)
    try:
        d = httpx.get(url + "/v1/workloads?size=5").json()["data"][0]
        assert d["inputs"] == {"pos": {"shape": [5, 3], "dtype": "float32"},
                               "types": {"shape": [5], "dtype": "int64", "range": [0, 20]}}
        req = w.make_inputs([6], seed=3)[0]
        body = {"inputs": {k: {"shape": list(req.tensors[k].shape), "data": req.tensors[k].flatten().tolist()}
                           for k in ("pos", "types")}}
        r = _infer(url, body, name="protein_e3nn")
        assert r.status_code == 200, r.text
        assert torch.equal(_output(r.json()), _reference(w, module, req))
        bad_types = json.loads(json.dumps(body))
        bad_types["inputs"]["types"]["data"][0] = 20
        r = _infer(url, bad_types, name="protein_e3nn")
        assert r.status_code == 400 and r.json()["error"]["code"] == "value_out_of_range"
        bad_types["inputs"]["types"]["data"][0] = 1.5
        assert _infer(url, bad_types, name="protein_e3nn").json()["error"]["code"] == "not_an_integer"
        with_graph = json.loads(json.dumps(body))
        with_graph["inputs"]["edge_index"] = {"shape": [2, 1], "data": [0, 99]}
        r = _infer(url, with_graph, name="protein_e3nn")
        assert r.status_code == 400 and "derived by the server" in r.json()["error"]["message"]
        assert _infer(url, {"size": 4, "seed": 1}, name="protein_e3nn").status_code == 200
    finally:
        _stop(server, thread)


def test_cli_serve_workload_serves_and_swaps():
    """``polyinf serve-workload`` as its own process: the documented help, a generated request, a swap."""
    help_text = subprocess.run([sys.executable, "-m", "pipelines.cli", "serve-workload", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "curl" in help_text and '"seed"' in help_text and '"inputs"' in help_text
    port = free_port()
    # one thread in the server and for the reference below: a CPU matmul's bits depend on how many threads split
    # it, and a default (all cores) takes fewer when the machine is busy (the parallel suite)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve-workload", "patchtst", "--port", str(port),
                             "--variant", '{"name": "eager"}', "--admin-token", TOKEN],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read())
            time.sleep(0.2)
        else:
            raise RuntimeError("serve-workload did not come up")
        w = get_workload("patchtst")
        ans = _infer(url, {"size": 2, "seed": 9}).json()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            want = _reference(w, w.build("cpu"), w.make_inputs([2], seed=9)[0])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(_output(ans), want)
        assert ans["variant_id"] == WorkloadVariant(name="eager").variant_id
        r = httpx.post(url + "/admin/variant", headers=ADMIN, json={"name": "b4", "max_batch": 4})
        assert r.status_code == 200
        assert _infer(url, {"size": 2, "seed": 9}).json()["variant_id"] == WorkloadVariant(max_batch=4).variant_id
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_variant_whose_first_pass_fails_is_taken_out_before_any_request_reaches_it(served):
    """A planted fault: the variant named "broken" builds a forward that raises (as a failed compile would)."""
    url, runner = served["url"], served["runner"]
    active = runner.variant.variant_id
    real = runner._forward_of

    def planted(variant):
        if variant.name != "broken":
            return real(variant)

        def fails(**_):
            raise RuntimeError("planted compile failure")
        return fails

    runner._forward_of = planted
    try:
        r = httpx.post(url + "/admin/variant", headers=ADMIN, json={"name": "broken", "max_batch": 3})
    finally:
        runner._forward_of = real
    assert r.status_code == 400 and r.json()["error"]["code"] == "variant_refused"
    assert "first forward pass failed" in r.json()["error"]["message"]
    assert runner.variant.variant_id == active
    assert _infer(url, {"size": 1, "seed": 4}).json()["variant_id"] == active


@pytest.mark.parametrize("name", ["fno", "weather_gnn", "protein_e3nn", "patchtst"])
def test_the_described_inputs_are_what_each_generator_makes_and_parse_back_to_its_size(name):
    """What GET /v1/workloads tells a client to send, at every size level, is what the workload's own generator
    makes; such a body parses back to the same size and tensors (derived ones recomputed)."""
    from engine.entrypoints.workload_protocol import input_specs, parse_request

    w = get_workload(name)
    specs = input_specs(w)
    for size in w.size_levels[:3]:
        req = w.make_inputs([size], seed=size)[0]
        assert {s.name: s.shape(size) for s in specs} == {
            k: list(v.shape) for k, v in req.tensors.items() if k in {s.name for s in specs}}
        parsed = parse_request(w, specs, _explicit_subset(req, {s.name for s in specs}))
        assert parsed.size == size and parsed.tensors.keys() == req.tensors.keys()
        assert all(torch.equal(parsed.tensors[k], v) for k, v in req.tensors.items())


def _explicit_subset(request, names: set[str]) -> dict:
    return {"inputs": {k: {"shape": list(v.shape), "data": v.flatten().tolist()}
                       for k, v in request.tensors.items() if k in names}}


def test_admin_body_types_cover_every_variant_field():
    """A field the admin body's type table misses would be refused (or, worse, taken unchecked)."""
    import dataclasses

    from engine.entrypoints.workload_protocol import _VARIANT_TYPES, variant_from_json

    assert set(_VARIANT_TYPES) == {f.name for f in dataclasses.fields(WorkloadVariant)}
    v = WorkloadVariant(name="d", deterministic=True, max_batch=2)
    got, _ = variant_from_json(v.to_json())
    assert got == v and got.variant_id == v.variant_id
