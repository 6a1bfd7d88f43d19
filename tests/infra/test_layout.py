"""The layout holds: imports go one way (kernels < engine < checks < ops < assets < pipelines), and inside engine/,
kernels/ and ops/ from one subpackage only down to those below it; no two modules import each other (function-level
imports included, bench/ too); no package holds more than 12 modules flat; modules stay readable; RESULTS.md stays a
dashboard."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kernels", "engine", "checks", "ops", "assets", "pipelines"]
# inside a layer, each subpackage (or top-level module) imports only those before it in its list
SUBLAYERS = {
    "engine": ["errors", "disk_cache", "config", "workloads", "generated", "model", "loader", "sched", "worker", "core",
               "serving", "entrypoints"],
    "kernels": ["pdl", "counters", "timing", "pointwise", "attention", "linear", "moe", "workloads", "generated"],
    "ops": ["traffic", "measure", "predict", "judge", "workloads", "search", "release"],
}
MAX_LINES = 500
MAX_FLAT = 12


def _modules(packages=LAYERS) -> dict[str, Path]:
    out = {}
    for pkg in packages:
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


def _graph(packages=LAYERS) -> dict[str, set[str]]:
    mods = _modules(packages)
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


def test_subpackages_import_only_down():
    bad = []
    for mod, deps in _graph().items():
        top, _, rest = mod.partition(".")
        order = SUBLAYERS.get(top)
        if not order or not rest:
            continue
        here = order.index(rest.split(".")[0])
        for d in deps:
            dtop, _, drest = d.partition(".")
            if dtop == top and drest and order.index(drest.split(".")[0]) > here:
                bad.append(f"{mod} imports {d}")
    assert not bad, bad


def test_every_subpackage_is_placed_and_none_is_flat_beyond_12_modules():
    for top, order in SUBLAYERS.items():
        found = {p.stem if p.is_file() else p.name for p in (ROOT / top).iterdir()
                 if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
        assert found == set(order), (top, sorted(found ^ set(order)))
    for init in [*ROOT.glob("*/__init__.py"), *ROOT.glob("*/*/__init__.py"), *ROOT.glob("*/*/*/__init__.py")]:
        if ".venv" in init.parts or "tests" in init.parts:
            continue
        flat = [p for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        assert len(flat) <= MAX_FLAT, (str(init.parent.relative_to(ROOT)), len(flat))


def test_no_import_cycles():
    graph = _graph([*LAYERS, "bench"])
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
