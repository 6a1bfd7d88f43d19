"""The pieces every benchmark shares (bench/lib/): the command line from a module's own options, arms measured in
alternation, batch-1 decode timed after its first token, a server that says why it did not start."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.lib import cli
from bench.lib.server import Server
from bench.lib.table import Table
from bench.lib.timing import alternate, decode_rate

ROOT = Path(__file__).resolve().parents[2]


def test_cli_parses_the_modules_own_options_and_returns_mains_status(capsys):
    seen = {}

    def add(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--rounds", type=int, default=3)

    def main(args: argparse.Namespace) -> int:
        seen["rounds"] = args.rounds
        return 7

    assert cli.run("A benchmark.\n\nMore text.", add, main, ["--rounds", "5"], prog="python -m bench x") == 7
    assert seen == {"rounds": 5}
    assert cli.run(None, add, lambda args: None, []) == 0
    with pytest.raises(SystemExit) as e:
        cli.run("A benchmark.\n\nMore text.", add, main, ["--help"], prog="python -m bench x")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "python -m bench x" in out and "A benchmark." in out and "More text" not in out and "--rounds" in out


def test_alternate_runs_every_arm_once_per_round_in_turn():
    calls = []
    arms = {name: (lambda name=name: calls.append(name) or float(len(calls))) for name in ("a", "b", "c")}
    got = alternate(arms, rounds=3)
    assert calls == ["a", "b", "c"] * 3
    assert got == {"a": [1.0, 4.0, 7.0], "b": [2.0, 5.0, 8.0], "c": [3.0, 6.0, 9.0]}


def test_table_appends_each_row_as_measured(tmp_path, capsys):
    t = Table(tmp_path / "rows.jsonl", width=10)
    t.row("first", "1 s")
    assert json.loads((tmp_path / "rows.jsonl").read_text()) == {"name": "first", "value": "1 s"}
    t.row("second", "2 s")
    assert t.markdown().splitlines() == ["| what | figure |", "|---|---|", "| first | 1 s |", "| second | 2 s |"]
    assert "first      1 s" in capsys.readouterr().out


def test_decode_rate_times_the_tokens_after_the_first():
    from engine import EngineConfig, LLMEngine
    from engine.config.source import ModelSource
    from engine.config.variant import VariantSpec

    eng = LLMEngine(EngineConfig(source=ModelSource("synthetic", str(ROOT / "tests/engine/tiny_moe"), seed=1),
                                 num_kv_blocks=64, load_tokenizer=False, variant=VariantSpec(block_size=4)))
    synced = []
    tokens, seconds = decode_rate(eng, [1, 5, 9], 6, sync=lambda: synced.append(1))
    assert tokens == 5 and seconds > 0 and not eng.has_unfinished() and len(synced) == 2


def test_a_server_that_cannot_start_says_why(tmp_path):
    server = Server(["--model", str(tmp_path / "no-such-model")], tmp_path / "server.log", startup_s=120)
    with pytest.raises(RuntimeError, match="polyinf serve exited") as e:
        server.start()
    assert "no-such-model" in str(e.value) and server.proc.poll() is not None
