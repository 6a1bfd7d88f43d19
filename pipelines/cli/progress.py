"""A search's progress on a terminal: its log lines, and below them one live line (rich) with the stage,
experiments done / queued per tier, the best so far and the time left in the budget.

``SearchProgress`` is a log callback (``tune(..., log=progress)``); ``tune`` attaches its search, from which each
message refreshes the counts. Only the thread that logs reads the board: the live line's own refreshes show the
last counts and recompute the time left alone."""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text


class SearchProgress:
    def __init__(self, budget_s: float, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stderr)
        self.deadline = time.time() + budget_s
        self.search = None
        self.stage = "starting"
        self.counts = ""
        self.best = ""
        self._live: Live | None = None

    def attach(self, search) -> None:
        self.search = search

    def __enter__(self) -> "SearchProgress":
        if self.console.is_terminal:
            self._live = Live(self, console=self.console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)
        self._note_stage(message)
        if self.search is not None:
            self._refresh_counts()

    def _note_stage(self, message: str) -> None:
        for key, stage in (("calibrat", "fast tier (calibration)"), ("fast tier", "fast tier"),
                           ("slow tier", "slow tier"), ("decision", "deciding"), ("gates", "gates")):
            if key in message:
                self.stage = stage
                return

    def _refresh_counts(self) -> None:
        from ops.search.tune import fast_score

        s = self.search
        rows = s.board.experiments(s.id)
        parts = []
        for tier in ("fast", "slow"):
            mine = [r for r in rows if r["tier"] == tier]
            if mine:
                done = sum(r["status"] in ("done", "failed") for r in mine)
                parts.append(f"{tier} {done}/{len(mine)} done")
        self.counts = ", ".join(parts)
        slow = [(r.bench.get("capacity", 0.0), v.name) for r, v in s.results("slow")]
        if slow:
            cap, name = max(slow)
            self.best = f"best so far: {name} at {cap:.3f} req/s (slow tier)"
        else:
            fast = [(fast_score(r.bench)[0], v.name) for r, v in s.results("fast")]
            if fast:
                cap, name = max(fast)
                self.best = f"best so far: {name}, implied {cap:.3f} req/s (fast tier)"

    def line(self) -> str:
        left = max(0.0, self.deadline - time.time())
        bits = [self.stage, self.counts, self.best, f"{left:.0f} s left in the budget" if left else "budget spent"]
        return " | ".join(b for b in bits if b)

    def __rich__(self) -> Text:
        return Text(self.line(), style="bold")
