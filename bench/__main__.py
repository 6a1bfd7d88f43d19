"""python -m bench NAME [options]: runs the benchmark bench/NAME.py (gpu.suite for bench/gpu/suite.py);
without a name, lists them with their first lines. Each benchmark defines ``add_cli_args(parser)`` and
``main(args)`` (bench/lib/cli.py)."""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Name -> first line of its docstring, for every benchmark module (one whose ``__main__`` block
    runs ``cli.run(__doc__, add_cli_args, main)``)."""
    out = {}
    for p in sorted(HERE.rglob("*.py")):
        rel = p.relative_to(HERE)
        if p.name.startswith("_") or rel.parts[0] == "lib":
            continue
        text = p.read_text()
        if "cli.run(__doc__, add_cli_args, main)" not in text:  # its __main__ block: a benchmark to run
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
    from bench.lib import cli

    module = importlib.import_module(f"bench.{name}")
    return cli.run(module.__doc__, module.add_cli_args, module.main, sys.argv[2:], prog=f"python -m bench {name}")


if __name__ == "__main__":
    sys.exit(main())
