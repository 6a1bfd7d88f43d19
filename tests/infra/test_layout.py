"""The layout holds: imports go one way (kernels < engine < checks < ops < assets < pipelines), no two modules
import each other (function-level imports included), modules stay readable, and RESULTS.md stays a dashboard."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kernels", "engine", "checks", "ops", "assets", "pipelines"]
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere (module or function level), except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, name, known) for name, path in mods.items()}


def test_imports_go_one_way():
    bad = []
    for mod, deps in _graph().items():
        layer = LAYERS.index(mod.split(".")[0])
        for d in deps:
            if LAYERS.index(d.split(".")[0]) > layer:
                bad.append(f"{mod} imports {d}")
    assert not bad, bad


def test_no_import_cycles():
    graph = _graph()
    # a module importing its own package's __init__ (e.g. engine.x -> engine) is how Python loads it, not a cycle
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []
    counter = iter(range(10**6))

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_modules_stay_readable():
    long = []
    for name, path in _modules().items():
        n = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if n > MAX_LINES and "longer than" not in doc:
            long.append(f"{name}: {n} lines")
    assert not long, long


def test_results_is_a_dashboard():
    lines = (ROOT / "bench" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 400
    assert (ROOT / "bench" / "results").is_dir()
