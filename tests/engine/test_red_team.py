"""Hostile generated kernels: each is refused with its reason, or contained (nothing it wants happens), and a
live server that is sent them keeps serving.

"Contained" is checked, not assumed: every payload that names a file aims at a canary path that must not
exist afterwards; the out-of-bounds kernels are run and must read only zeros; the hanging kernels must
fail their smoke run at its time limit.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.errors import VariantError
from engine.generated.source import load_kernel, materialize, prepare_generated
from engine.generated.grammar import check_kernel
from kernels.generated.launch import make_launcher
from ops.release.deploy import free_port

CANARY = Path(os.environ.get("TMPDIR", "/tmp")) / "polyinf-red-team-canary"
HEAD = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
SIG = "def silu_and_mul(x_ptr, out_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr):\n"
BODY = ("    row = tl.program_id(0)\n"
        "    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)\n"
        "    g = tl.load(x_ptr + row * 2 * D + cols, mask=cols < D, other=0.0)\n"
        "    u = tl.load(x_ptr + row * 2 * D + D + cols, mask=cols < D, other=0.0)\n"
        "    tl.store(out_ptr + row * D + cols, g * tl.sigmoid(g) * u, mask=cols < D)\n")
GOOD = HEAD + SIG + BODY


def kernel(body: str, head: str = HEAD, sig: str = SIG) -> str:
    return head + sig + body


# (name, module text, the reason it is refused with)
REFUSED = [
    ("import os", "import os\n" + GOOD, "import 'os' is not allowed"),
    ("import aliased as tl", "import subprocess as tl\n" + GOOD, "import 'subprocess as tl' is not allowed"),
    ("from torch.hub import load", "from torch.hub import load\n" + GOOD, "top-level ImportFrom"),
    ("cpp_extension load_inline", "from torch.utils.cpp_extension import load_inline\n" + GOOD, "top-level ImportFrom"),
    ("import triton.runtime", "import triton.runtime\n" + GOOD, "import 'triton.runtime' is not allowed"),
    ("import inside the kernel", kernel("    import os\n" + BODY), "Import statements are not allowed"),
    ("attribute chain through tl", kernel("    f = tl.core.tensor\n" + BODY), "attribute 'tl.core.tensor'"),
    ("libdevice through tl.extra", kernel("    y = tl.extra.cuda.libdevice.exp(1.0)\n" + BODY), "call of"),
    ("triton.runtime in the body", kernel("    d = triton.runtime.driver\n" + BODY), "attribute 'triton.runtime.driver'"),
    ("top-level call", GOOD + "print(open('/etc/passwd').read())\n", "top-level Expr is not allowed"),
    ("top-level assignment", GOOD + f"X = open('{CANARY}', 'w')\n", "top-level Assign is not allowed"),
    ("a second decorator", HEAD.replace("@triton.jit\n", f"@triton.jit\n@(lambda f: open('{CANARY}', 'w') and f)\n")
     + SIG + BODY, "exactly one decorator"),
    ("decorator with arguments", HEAD.replace("@triton.jit", "@triton.jit(do_not_specialize=[0])") + SIG + BODY,
     "exactly one decorator"),
    ("default argument", kernel(BODY, sig=SIG.replace("BLOCK_D: tl.constexpr)", f"BLOCK_D: tl.constexpr = open('{CANARY}', 'w'))")),
     "default argument values"),
    ("annotation payload", kernel(BODY, sig=SIG.replace("D: tl.constexpr,", f"D: open('{CANARY}', 'w'),")),
     "must be annotated tl.constexpr"),
    ("string-built name", kernel("    f = getattr(tl, 'lo' + 'ad')\n" + BODY), "call of 'getattr'"),
    ("string literal", kernel("    s = 'os'\n" + BODY), "literal 'os'"),
    ("shadowing tl", kernel("    tl = D\n" + BODY), "shadowing 'tl'"),
    ("shadowing tl in a loop", kernel("    for tl in range(0, D):\n        pass\n" + BODY), "shadowing 'tl'"),
    ("inline assembly", kernel("    y = tl.inline_asm_elementwise(1, 2, 3, 4, 5, 6)\n" + BODY),
     "tl.inline_asm_elementwise is not an allowed function"),
    ("device print (huge output)", kernel("    tl.device_print(1, 2)\n" + BODY), "tl.store"),
    ("store into an input", kernel(BODY + "    tl.store(x_ptr + cols, g)\n"), "only the outputs"),
    ("pointer kept in a variable", kernel("    p = x_ptr + 1\n" + BODY), "pointer 'x_ptr' may appear only"),
    ("pointer subtracted", kernel(BODY.replace("tl.load(x_ptr + row", "tl.load(0 - x_ptr + row")),
     "<pointer parameter> + <offsets>"),
    ("forged bounds", kernel("    _n_x_ptr = 1 << 40\n" + BODY), "reserved"),
    ("while loop", kernel("    while True:\n        pass\n" + BODY), "While statements are not allowed"),
    ("data-dependent loop", kernel("    n = tl.load(x_ptr + 0)\n    for i in range(0, n):\n        pass\n" + BODY),
     "a loop bound may use only"),
    ("zero loop step", kernel("    for i in range(0, D, 0):\n        pass\n" + BODY), "positive integer literal"),
    ("memory bomb", kernel("    big = tl.zeros([1048576, 1048576], tl.float32)\n" + BODY), "shape must be"),
    ("memory bomb by arithmetic", kernel("    big = tl.zeros([BLOCK_D * BLOCK_D * BLOCK_D], tl.float32)\n" + BODY),
     "shape must be"),
    ("huge integer", kernel("    a = 1 << 2147483647\n" + BODY), "shift's amount"),
    ("file access", kernel(f"    f = open('{CANARY}', 'w')\n" + BODY), "call of 'open'"),
    ("socket", "import socket\n" + GOOD, "import 'socket'"),
    ("process creation", kernel("    p = __import__('os').system('touch " + str(CANARY) + "')\n" + BODY),
     "call of"),
    ("dunder escape", kernel("    c = D.__class__.__bases__\n" + BODY), "attribute"),
    ("lambda", kernel("    f = lambda: 0\n" + BODY), "Lambda expressions"),
    ("comprehension", kernel("    f = [i for i in range(3)]\n" + BODY), "ListComp expressions"),
    ("walrus", kernel("    f = (y := 3)\n" + BODY), "NamedExpr expressions"),
    ("global", kernel("    global tl\n" + BODY), "Global statements"),
    ("return", kernel(BODY + "    return 1\n"), "Return statements"),
    ("nested function", kernel("    def inner():\n        pass\n" + BODY), "FunctionDef statements"),
    ("class", GOOD + "class Evil:\n    pass\n", "top-level ClassDef"),
    ("try/except", kernel("    try:\n        pass\n    except Exception:\n        pass\n" + BODY), "Try statements"),
    ("with", kernel(f"    with open('{CANARY}') as f:\n        pass\n" + BODY), "With statements"),
    ("two functions", GOOD + "\n\n" + HEAD + SIG.replace("silu_and_mul", "helper") + BODY, "exactly one kernel"),
    ("starred arguments", kernel("    y = tl.sum(*cols)\n" + BODY), "*args"),
    ("attribute on a result", kernel("    y = tl.arange(0, BLOCK_D).T\n" + BODY), "attribute"),
    ("bitcast keyword", kernel(BODY + "    y = cols.to(tl.float32, bitcast=True)\n"), "x.to(...) takes"),
    ("wrong signature", HEAD + "def silu_and_mul(x_ptr, out_ptr, D, BLOCK_D, k_cache_ptr):\n" + BODY,
     "takes (x_ptr, out_ptr, D, BLOCK_D)"),
    ("not Python", "def silu_and_mul(:\n", "not valid Python"),
    ("deep parentheses", kernel("    y = " + "(" * 400 + "1" + ")" * 400 + "\n" + BODY), "too many nested parentheses"),
    ("deep unary chain", kernel("    y = " + "-" * 10000 + "1\n" + BODY), "nested too deeply"),
    ("oversized module", GOOD + "#" * 30000 + "\n", "a generated kernel has at most"),
]

# kernels the grammar admits whose intent is contained when they run: read beyond their inputs (masked:
# they read zeros), or never finish (their smoke run is killed at its limit). Each with the gate values it
# must have read, from x (rows, 2 * D) flattened: only x's own elements or zeros.
OUT_OF_BOUNDS = {
    "far past the input": (BODY.replace("x_ptr + row * 2 * D + cols", "x_ptr + 1000000000 + cols"),
                           lambda xf, c: torch.zeros(len(c))),
    "before the input": (BODY.replace("x_ptr + row * 2 * D + cols", "x_ptr + (cols - 4096)"),
                         lambda xf, c: torch.zeros(len(c))),
    # int32 offsets wrap to cols - 2, inside x: what is read is x's own, never beyond it
    "int32 wrap-around": (BODY.replace("x_ptr + row * 2 * D + cols", "x_ptr + (cols + 2147483647 + 2147483647)"),
                          lambda xf, c: torch.where(c >= 2, xf[(c - 2).clamp(min=0)], torch.zeros(len(c)))),
}
HANGS = {
    "a loop of 4e18 iterations": BODY + "    acc = tl.zeros([BLOCK_D], tl.float32)\n"
                                        "    for i in range(0, 2147483647):\n        for j in range(0, 2147483647):\n"
                                        "            acc = acc * 1.0000001 + 1.0\n"
                                        "    tl.store(out_ptr + row * D + cols, acc, mask=cols < D)\n",
}


@pytest.mark.parametrize("name, text, reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_hostile_module_is_refused_with_its_reason(name, text, reason):
    with pytest.raises(VariantError, match=re.escape(reason)) as e:
        check_kernel("silu_and_mul", "evil", "silu_and_mul", text)
    assert "generated module evil" in str(e.value)
    assert not CANARY.exists()


def test_the_corpus_is_large_and_the_good_kernel_passes():
    assert len(REFUSED) + len(OUT_OF_BOUNDS) + len(HANGS) >= 25
    check_kernel("silu_and_mul", "good", "silu_and_mul", GOOD)


@pytest.mark.parametrize("name", list(OUT_OF_BOUNDS))
def test_out_of_bounds_reads_are_masked_to_zeros(name, tmp_path, monkeypatch):
    """Run in this process on purpose: the rewrite's masks, not a child, keep the reads inside x."""
    monkeypatch.setenv("POLYINF_CACHE", str(tmp_path))
    body, gate_read = OUT_OF_BOUNDS[name]
    text = kernel(body)
    bounded = check_kernel("silu_and_mul", "oob", "silu_and_mul", text)
    launch = make_launcher("silu_and_mul", load_kernel(materialize("oob", bounded), bounded, "silu_and_mul"),
                           {"BLOCK_D": 16})
    x = torch.randn(3, 32) + 5.0  # every gate value is far from zero
    out = launch(x)
    gate = gate_read(x.flatten(), torch.arange(16)).expand(3, 16)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * x[:, 16:])
    with pytest.raises(VariantError, match="differs from the reference"):
        prepare_generated("silu_and_mul", "oob", "silu_and_mul", text, {"BLOCK_D": 16})


@pytest.mark.parametrize("name", list(HANGS))
def test_a_kernel_that_never_finishes_fails_its_smoke_run(name, monkeypatch):
    import engine.generated.source as gs

    monkeypatch.setattr(gs, "SMOKE_TIMEOUT_S", 3.0)
    t0 = time.perf_counter()
    with pytest.raises(VariantError, match="did not finish in 3 s"):
        gs.smoke_in_child("silu_and_mul", gs.materialize("hang", check_kernel("silu_and_mul", "hang", "silu_and_mul",
                                                                              kernel(HANGS[name]))),
                          "silu_and_mul", {"BLOCK_D": 16}, None, "cpu", timeout_s=3.0)
    assert time.perf_counter() - t0 < 60


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    tiny = Path(__file__).parent / "tiny_moe"
    port = free_port()
    env = {**os.environ, "POLYINF_ADMIN_TOKEN": "red-team-token", "POLYINF_SMOKE_TIMEOUT_S": "15",
           "POLYINF_CACHE": str(tmp_path_factory.mktemp("cache"))}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", "--model", str(tiny), "--synthetic",
                             "--port", str(port), "--num-kv-blocks", "64"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.25)
    else:
        proc.kill()
        raise RuntimeError("server did not come up: " + proc.stderr.read()[-2000:])
    yield {"url": url, "model": str(tiny), "proc": proc}
    proc.terminate()
    proc.wait(timeout=20)


@pytest.mark.slow  # a server process, a smoke child per kernel that passes the grammar, and a 15 s hang
def test_a_live_server_refuses_the_whole_corpus_and_keeps_serving(tiny_server):
    url, auth = tiny_server["url"], {"Authorization": "Bearer red-team-token"}
    active = httpx.get(url + "/admin/variant", headers=auth).json()["active"]
    base = {k: v for k, v in active.items() if k != "variant_id"}
    corpus = [(n, t) for n, t, _ in REFUSED] + [(n, kernel(b)) for n, (b, _) in OUT_OF_BOUNDS.items()] + \
        [(n, kernel(b)) for n, b in HANGS.items()]
    for name, text in corpus:
        spec = {**base, "kernels": {"silu_and_mul": "generated:evil.silu_and_mul"},
                "kernel_params": {"silu_and_mul": {"BLOCK_D": 16}}, "generated_source": {"evil": text}}
        r = httpx.post(url + "/admin/variant", headers=auth, json=spec, timeout=120)
        assert r.status_code == 422, (name, r.status_code, r.text)
        body = r.json()["error"]
        assert body["code"] == "variant_refused" and "previous variant stays active" in body["message"], name
        assert httpx.get(url + "/admin/variant", headers=auth).json()["active"]["variant_id"] == \
            active["variant_id"], name
        done = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": tiny_server["model"], "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, name
    assert not CANARY.exists()
    assert tiny_server["proc"].poll() is None
    # no smoke child outlives its run
    children = subprocess.run(["pgrep", "-P", str(tiny_server["proc"].pid)], capture_output=True, text=True).stdout
    assert children.strip() == ""
    good = {**base, "kernels": {"silu_and_mul": "generated:good.silu_and_mul"},
            "kernel_params": {"silu_and_mul": {"BLOCK_D": 64}}, "generated_source": {"good": GOOD}}
    r = httpx.post(url + "/admin/variant", headers=auth, json=good, timeout=300)
    assert r.status_code == 200, r.text  # the path works for a kernel that is what it claims
    assert httpx.post(url + "/admin/rollback", headers=auth, timeout=300).status_code == 200
    assert json.loads(httpx.get(url + "/admin/variant", headers=auth).text)["active"]["variant_id"] == \
        active["variant_id"]
