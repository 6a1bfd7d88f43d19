"""Each benchmark is a module with ``add_cli_args(parser)`` and ``main(args)``; ``python -m bench NAME`` (and the
module's own ``__main__`` block) builds the parser from its docstring, parses and runs it."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def parser(doc: str | None, add_cli_args: Callable[[argparse.ArgumentParser], None],
           prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser: its docstring's first paragraph as the description, its own options."""
    ap = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])
    add_cli_args(ap)
    return ap


def run(doc: str | None, add_cli_args: Callable[[argparse.ArgumentParser], None],
        main: Callable[[argparse.Namespace], int | None], argv: list[str] | None = None,
        prog: str | None = None) -> int:
    """Parses ``argv`` (the command line's by default) and runs ``main``; its return value is the exit status
    (None: 0)."""
    args = parser(doc, add_cli_args, prog).parse_args(argv)
    return int(main(args) or 0)


def add_model_args(ap: argparse.ArgumentParser, trace: bool = False) -> None:
    """The options most benchmarks share: ``--model`` (a preset, GGUF file or folder; default SmolLM2), ``--device``
    and ``--dtype`` (default the CPU's float32), and with ``trace`` the ``--trace`` to replay (default the Azure
    conversation trace that ships in traces/)."""
    from pathlib import Path

    ap.add_argument("--model", default="smollm2")
    if trace:
        ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "traces"
                                               / "AzureLLMInferenceTrace_conv.csv"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
