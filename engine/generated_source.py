"""Generated kernel source: checked before it runs, smoke-run in a child process, loaded from a content-addressed path.

The check is a static allow-list over the syntax tree: imports only from torch, triton and
math; no names or attributes that reach files, processes, the network, or code evaluation
(open, eval, exec, compile, __import__, getattr, torch.load/save/hub, dunder attributes...).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

from engine.errors import EngineError

ALLOWED_IMPORTS = {"torch", "triton", "math"}
FORBIDDEN_NAMES = {
    "open", "eval", "exec", "compile", "__import__", "globals", "locals", "vars", "getattr", "setattr", "delattr",
    "input", "breakpoint", "exit", "quit", "memoryview", "__builtins__", "help", "dir", "type", "object",
}
FORBIDDEN_ATTRS = {
    "load", "save", "hub", "from_file", "system", "popen", "os", "sys", "subprocess", "socket", "_C", "cpp_extension",
    "library", "load_library", "utils", "jit_load", "classes", "__dict__", "__class__", "__globals__",
    "__subclasses__", "__bases__", "__code__", "__builtins__", "__getattribute__",
}


class VariantError(EngineError):
    """A variant that cannot be applied; the previous variant stays active."""


def check_source(module: str, text: str) -> None:
    """Raises VariantError naming the first forbidden construct."""
    if not module.isidentifier():
        raise VariantError(f"generated module name {module!r} is not an identifier")
    try:
        tree = ast.parse(text, filename=f"{module}.py")
    except SyntaxError as e:
        raise VariantError(f"generated module {module}: syntax error at line {e.lineno}: {e.msg}") from None
    for node in ast.walk(tree):
        where = f"generated module {module}, line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED_IMPORTS:
                    raise VariantError(f"{where}: import of {alias.name!r} is not allowed (only torch, triton, math)")
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] not in ALLOWED_IMPORTS:
                raise VariantError(f"{where}: import from {node.module!r} is not allowed (only torch, triton, math)")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            raise VariantError(f"{where}: use of {node.id!r} is not allowed")
        elif isinstance(node, ast.Attribute) and (node.attr in FORBIDDEN_ATTRS or node.attr.startswith("__")):
            raise VariantError(f"{where}: attribute {node.attr!r} is not allowed")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            raise VariantError(f"{where}: global/nonlocal statements are not allowed")


def cache_root() -> Path:
    return Path(os.environ.get("POLYINF_CACHE", Path.home() / ".cache" / "polyinf"))


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


def load_function(path: Path, function: str) -> Callable:
    name = f"polyinf_generated_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise VariantError(f"generated module {path.stem} failed to import: {type(e).__name__}: {e}") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise VariantError(f"generated module {path.stem} has no function {function!r}")
    return fn


# ---- smoke runs: small inputs for each operation, checked against the reference ---------------------
def smoke_case(op: str) -> tuple[tuple, Callable]:
    """Arguments for one small call of ``op`` and the reference implementation."""
    from engine.forward_ops import REFERENCE_OPS

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "rms_norm":
        args = (r(5, 24), r(24), 1e-6)
    elif op == "fused_add_rms_norm":
        args = (r(5, 24), r(5, 24), r(24), 1e-6)
    elif op == "rotary":
        cs = torch.stack([torch.cos(torch.arange(64.0)[:, None] * 0.1 * torch.arange(1, 5)),
                          torch.sin(torch.arange(64.0)[:, None] * 0.1 * torch.arange(1, 5))], dim=1)
        args = (r(3, 4, 8), r(3, 2, 8), torch.tensor([0, 5, 63]), cs.contiguous())
    elif op == "silu_and_mul":
        args = (r(4, 40),)
    elif op == "store_kv":
        args = (r(3, 2, 8), r(3, 2, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8), torch.tensor([0, 5, 15]))
    elif op == "attention":
        from kernels.attention import AttentionMetadata

        meta = AttentionMetadata.build(torch.zeros(4, dtype=torch.int64),
                                       torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), [6, 5], [0, 3, 4], "cpu")
        args = (r(4, 4, 8), r(4, 4, 2, 8), r(4, 4, 2, 8), meta, 8**-0.5)
    elif op == "rotary_attention":  # two decoding sequences of 6 and 5 tokens, q/k head norms
        from kernels.attention import AttentionMetadata

        cs = torch.stack([torch.cos(torch.arange(64.0)[:, None] * 0.1 * torch.arange(1, 5)),
                          torch.sin(torch.arange(64.0)[:, None] * 0.1 * torch.arange(1, 5))], dim=1)
        meta = AttentionMetadata.build(torch.tensor([5, 12]), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                       [6, 5], [0, 1, 2], "cpu")
        args = (r(2, 4, 8), r(2, 2, 8), r(2, 2, 8), r(8), r(8), 1e-6, torch.tensor([5, 4]), cs.contiguous(),
                r(4, 4, 2, 8), r(4, 4, 2, 8), meta, 8**-0.5)
    elif op == "moe":
        args = (r(5, 8), r(5, 4), r(4, 12, 8), r(4, 8, 6), 2, True)
    elif op == "linear":
        args = (r(3, 24), r(10, 24), r(10))
    elif op == "norm_linear":
        args = (r(3, 24), r(3, 24), r(24), 1e-6, r(10, 24), None)
    elif op == "act_linear":
        args = (r(3, 48), r(10, 24))
    elif op == "norm_moe":
        args = (r(5, 8), r(5, 8), r(8), 1e-6, r(4, 8), r(4, 12, 8), r(4, 8, 6), 2, True)
    else:
        raise VariantError(f"unknown operation {op!r}")
    return args, getattr(REFERENCE_OPS, op)


def smoke_run(op: str, fn: Callable) -> None:
    """Runs ``fn`` on a small case; raises VariantError if it throws or returns the wrong shape or non-finite values."""
    args, ref = smoke_case(op)
    ref_args, _ = smoke_case(op)
    try:
        out = fn(*args)
    except Exception as e:
        raise VariantError(f"{op}: raised {type(e).__name__}: {e}") from None
    expected = ref(*ref_args)
    if op == "store_kv":
        out, expected = (args[2], args[3]), (ref_args[2], ref_args[3])
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    if len(outs) != len(exps):
        raise VariantError(f"{op}: returned {len(outs)} tensors, expected {len(exps)}")
    for o, e in zip(outs, exps):
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(e.shape):
            shape = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            raise VariantError(f"{op}: wrong output shape {shape}, expected {tuple(e.shape)}")
        if o.dtype != e.dtype:
            raise VariantError(f"{op}: wrong output dtype {o.dtype}, expected {e.dtype}")
        if not torch.isfinite(o).all():
            raise VariantError(f"{op}: output has NaN or Inf")


def smoke_in_child(path: Path, function: str, op: str, timeout: float = 300.0) -> None:
    """Imports and smoke-runs the generated function in a separate process, so a crash or hang stays there."""
    code = ("import sys; from pathlib import Path; from engine.generated_source import load_function, smoke_run; "
            "smoke_run(sys.argv[3], load_function(Path(sys.argv[1]), sys.argv[2])); print('ok')")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(path), function, op], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        raise VariantError(f"{op}: smoke run of generated {path.stem}.{function} timed out after {timeout:.0f} s") from None
    if r.returncode != 0 or not r.stdout.strip().endswith("ok"):
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit status {r.returncode}"
        raise VariantError(f"{op}: smoke run of generated {path.stem}.{function} failed in a child process: {reason}")


def prepare_generated(op: str, module: str, function: str, text: str) -> Callable:
    """Check, write, smoke-run in a child, load, and smoke-run again here. Returns the callable."""
    check_source(module, text)
    path = materialize(module, text)
    smoke_in_child(path, function, op)
    fn = load_function(path, function)
    smoke_run(op, fn)
    return fn

