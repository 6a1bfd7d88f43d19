"""The ``polyinf`` command line: one module per command group (engine_cmds, traffic_cmds, tuning_cmds,
workload_serve_cmds).

Every subcommand turns bad input into one clear line on stderr and a non-zero exit: ``main`` handles
the project's errors once. Heavy imports (torch, transformers, dagster) happen inside the subcommands.
"""
from __future__ import annotations

import argparse
import os
import sys

from pipelines.cli import engine_cmds, traffic_cmds, tuning_cmds, workload_serve_cmds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyinf",
        description="Polymorphic Inference: an LLM inference engine kept tuned to its traffic, model and hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (engine_cmds, traffic_cmds, tuning_cmds, workload_serve_cmds):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        # Triton kernels (built-in and generated) run on a CPU in Triton's interpreter, which must be chosen
        # before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from engine.errors import EngineError
        from ops.traffic.traces import TraceError
    except ImportError as e:  # pragma: no cover
        print(f"polyinf: cannot import the engine: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (EngineError, TraceError) as e:
        print(f"polyinf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
