"""python -m bench NAME [options]: runs the benchmark bench/NAME.py (gpu.suite for bench/gpu/suite.py);
without a name, lists them with their first lines."""
from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Name -> first line of its docstring, for every module with a ``__main__`` block."""
    out = {}
    for p in sorted(HERE.rglob("*.py")):
        rel = p.relative_to(HERE)
        if p.name.startswith("_") or rel.parts[0] == "lib":
            continue
        text = p.read_text()
        if '__name__ == "__main__"' not in text:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        out[".".join(rel.with_suffix("").parts)] = doc.split("\n")[0]
    return out


def main() -> int:
    known = benchmarks()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.split(";")[0] + "\n")
        for name, doc in known.items():
            print(f"  {name:22} {doc}")
        return 0
    name = sys.argv[1]
    if name not in known:
        print(f"unknown benchmark {name!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m bench {name}", *sys.argv[2:]]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
