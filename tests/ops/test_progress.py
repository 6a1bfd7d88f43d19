"""The search's live progress line: stage, experiments per tier, the best so far, time left."""
from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from engine.config.variant import VariantSpec
from pipelines.cli.progress import SearchProgress


class _Board:
    def __init__(self, rows):
        self.rows = rows

    def experiments(self, search):
        return self.rows


def test_the_live_line_follows_the_search():
    rows = [{"tier": "fast", "status": "done"}, {"tier": "fast", "status": "done"}, {"tier": "fast", "status": "queued"},
            {"tier": "slow", "status": "running"}]
    results = {"fast": [(SimpleNamespace(bench={"predicted": {"capacity": 0.5}, "output_tok_s": 9.0}),
                         VariantSpec(name="grid s4"))],
               "slow": []}
    search = SimpleNamespace(id="s1", board=_Board(rows), results=lambda tier: results[tier])
    out = io.StringIO()
    p = SearchProgress(600, Console(file=out, force_terminal=True, width=200))
    with p:
        p.attach(search)
        p("fast tier: grid s4 measured in 2 s: 9.0 decode tok/s; 1 queued")
        line = p.line()
        assert line.startswith("fast tier | fast 2/3 done, slow 0/1 done | best so far: grid s4, implied 0.500 req/s")
        assert "s left in the budget" in line
        results["slow"] = [(SimpleNamespace(bench={"capacity": 0.31}), VariantSpec(name="static-best"))]
        p("slow tier: static-best measured in 80 s: capacity 0.310 req/s")
        assert "slow tier | " in p.line() and "static-best at 0.310 req/s (slow tier)" in p.line()
    assert "measured in 80 s" in out.getvalue()  # the log lines themselves stay on the terminal


def test_without_a_terminal_only_the_log_lines_print():
    out = io.StringIO()
    with SearchProgress(60, Console(file=out, force_terminal=False)) as p:
        p("search s1: cost model ranked 8 knob variants")
    assert out.getvalue() == "search s1: cost model ranked 8 knob variants\n"
