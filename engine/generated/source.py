"""Generated kernels: checked against the grammar, smoke-run in an isolated child, then launched by the
project's own wrapper for their operation.

The path of a generated kernel (design note: engine/generated/grammar.py says why a grammar):
1. ``check_kernel`` parses the module and refuses anything outside the allow-listed Triton subset; the
   kernel it returns has every load and store masked to its own tensors' bounds.
2. The bounded source is written under a content-addressed path (the same text, the same file).
3. A child process (engine/generated/isolation.py: scrubbed environment, private directory, no network, limits)
   loads it and runs it on small cases and at the model's served shapes against the plain-torch
   reference, within a time limit: a kernel that crashes, hangs, or computes something else fails here.
   A pass is kept for the process: the same file at the same tiles and shapes is not run in a child again.
4. Only then is it loaded here: compiled from the checked syntax tree in a namespace holding nothing
   but ``triton`` and ``tl`` (no builtins but ``range``), never imported, and wrapped by
   ``kernels.generated.launch.make_launcher``, which hands it only bounded views of its operation's arguments.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from engine.disk_cache import cache_root
from engine.errors import VariantError
from engine.generated.isolation import confine, run_isolated
from engine.generated.grammar import check_kernel
from kernels.generated.launch import REFERENCES, make_launcher, smoke_cases

SMOKE_TIMEOUT_S = float(os.environ.get("POLYINF_SMOKE_TIMEOUT_S", "300"))
# a smoke run's check is coarse (a kernel computing something else); the quality gate judges accuracy
SMOKE_TOLERANCE = 5e-2  # of the reference's largest magnitude (at least 1)
SMOKE_MEMORY = 16 * 1024**3  # address space of a CPU smoke child (torch reserves several GiB of it)


# (op, kernel file, function, params, dims, device) whose smoke run in a child passed in this process: the kernel
# file is content-addressed, so the same key is the same code at the same shapes. The gates build a dozen engines
# of one variant; each would otherwise start a child for a kernel already run there. Failures are not kept.
_SMOKED: set[tuple] = set()


def materialize(module: str, text: str) -> Path:
    """Writes the source under a path named by its content hash; the same text always lands on the same file."""
    digest = hashlib.sha256(f"{module}\0{text}".encode()).hexdigest()[:20]
    path = cache_root() / "generated" / digest / f"{module}.py"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def load_kernel(path: Path, text: str, function: str):
    """The ``@triton.jit`` kernel of a checked, bounded module (``text``, stored at ``path``), compiled in a
    namespace of ``triton`` and ``tl`` alone. The module's imports are not run."""
    import triton
    import triton.language as tl

    if path.read_text() != text:
        raise VariantError(f"generated module {path.stem}: the stored file differs from the checked source")
    tree = ast.parse(text, filename=str(path))
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    namespace = {"__builtins__": {"range": range}, "__name__": f"polyinf_generated_{path.parent.name}",
                 "triton": triton, "tl": tl}
    exec(compile(ast.Module(fn, []), str(path), "exec"), namespace)  # defines the function, runs nothing
    return namespace[function]


def smoke(op: str, kernel, params: dict, dims: dict | None, device: str) -> list[dict]:
    """Runs the launched kernel on ``op``'s smoke cases against the reference; raises VariantError on an
    exception, a wrong shape or dtype, a non-finite value, or a result the reference does not match."""
    fn = make_launcher(op, kernel, params)
    ref = REFERENCES[op]
    out = []
    gen = torch.Generator(device=torch.device(device)).manual_seed(0)
    for i, args in enumerate(smoke_cases(op, dims, gen, device)):
        shape = "x".join(str(d) for d in args[0].shape)
        try:
            got = fn(*args)
        except Exception as e:
            raise VariantError(f"{op}: the generated kernel raised on case {i} ({shape}): {type(e).__name__}: "
                               f"{str(e)[:300]}") from None
        want = ref(*args)
        gots, wants = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        if not isinstance(gots, tuple) or len(gots) != len(wants):
            raise VariantError(f"{op}: the launcher returned {type(got).__name__}, expected {len(wants)} tensors")
        for g, w in zip(gots, wants):
            if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
                raise VariantError(f"{op}: case {i} ({shape}) gave {tuple(g.shape)} {g.dtype}, expected "
                                   f"{tuple(w.shape)} {w.dtype}")
            if not torch.isfinite(g).all():
                raise VariantError(f"{op}: case {i} ({shape}) gave NaN or Inf")
            err = (g.float() - w.float()).abs().max().item()
            scale = max(1.0, w.float().abs().max().item())
            if err > SMOKE_TOLERANCE * scale:
                raise VariantError(f"{op}: case {i} ({shape}) differs from the reference by {err:.3g} "
                                   f"(allowed {SMOKE_TOLERANCE * scale:.3g})")
        out.append({"case": i, "shape": shape, "max_abs_err": err})
    return out


def smoke_in_child(op: str, path: Path, function: str, params: dict, dims: dict | None, device: str,
                   timeout_s: float = SMOKE_TIMEOUT_S) -> list[dict]:
    """Smoke-runs the kernel in an isolated child (engine/generated/isolation.py); VariantError if it fails or hangs."""
    job = {"op": op, "path": str(path), "function": function, "params": params, "dims": dims, "device": device}
    extra = {} if device.startswith("cuda") else {"TRITON_INTERPRET": "1"}
    r = run_isolated([sys.executable, "-c", "from engine.generated.source import child_main; child_main()"],
                     timeout_s, json.dumps(job), extra)
    where = f"{op}: smoke run of generated {path.stem}.{function}"
    if r.timed_out:
        raise VariantError(f"{where} did not finish in {timeout_s:.0f} s")
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    try:
        reply = json.loads(last)
    except json.JSONDecodeError:
        reply = None
    if r.returncode != 0 or not isinstance(reply, dict):
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip() and "polyinf isolation" not in ln]
        reason = lines[-1][:500] if lines else f"exit status {r.returncode}"
        raise VariantError(f"{where} failed in a child process: {reason}")
    if "error" in reply:
        raise VariantError(str(reply["error"])[:1000])
    return reply["cases"]


def child_main() -> None:
    """The smoke child: confine, read the job from stdin, load, run, answer one JSON line."""
    job = json.loads(sys.stdin.read())
    cuda = job["device"].startswith("cuda")
    confine(memory_bytes=None if cuda else SMOKE_MEMORY)
    try:
        text = Path(job["path"]).read_text()
        kernel = load_kernel(Path(job["path"]), text, job["function"])
        cases = smoke(job["op"], kernel, job["params"], job["dims"], job["device"])
        if cuda:
            torch.cuda.synchronize()
        print(json.dumps({"cases": cases}))
    except VariantError as e:
        print(json.dumps({"error": str(e)}))


def prepare_generated(op: str, module: str, function: str, text: str, params: dict | None = None,
                      dims: dict | None = None, device: str = "cpu") -> Callable:
    """Check, bound, store, smoke-run in an isolated child, load here and smoke-run again. Returns ``op``
    running the kernel through its launcher. Raises VariantError, with the reason, at the first failure."""
    params = dict(params or {})
    try:
        make_launcher(op, None, params)  # the tiles, checked before anything runs
    except ValueError as e:
        raise VariantError(f"{op}=generated:{module}.{function}: bad kernel_params: {e}") from None
    bounded = check_kernel(op, module, function, text)
    if not device.startswith("cuda") and not interpreting():
        raise VariantError(f"{op}: generated Triton kernels need a GPU, or TRITON_INTERPRET=1 set before the "
                           "engine starts on a CPU")
    path = materialize(module, bounded)
    smoked = (op, str(path), function, json.dumps(params, sort_keys=True), json.dumps(dims, sort_keys=True), device)
    if smoked not in _SMOKED:
        smoke_in_child(op, path, function, params, dims, device)
        _SMOKED.add(smoked)
    kernel = load_kernel(path, bounded, function)
    smoke(op, kernel, params, None, device)  # compiled here too: the small cases only, the served ones ran there
    return make_launcher(op, kernel, params)
