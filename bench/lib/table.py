"""Rows of (what, figure): each printed as it is measured and, when a file is given, appended to it as a JSON
line at once (a run cut short keeps what it measured); at the end one markdown table."""
from __future__ import annotations

import json
from pathlib import Path


class Table:
    def __init__(self, jsonl: Path | None = None, width: int = 60, as_object: bool = True) -> None:
        self.rows: list[tuple[str, str]] = []
        self.jsonl, self.width, self.as_object = jsonl, width, as_object

    def row(self, name: str, value: str) -> None:
        self.rows.append((name, value))
        print(f"{name:{self.width}} {value}", flush=True)
        if self.jsonl is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"name": name, "value": value} if self.as_object else [name, value]) + "\n")

    def markdown(self) -> str:
        return "\n".join(["| what | figure |", "|---|---|", *(f"| {n} | {v} |" for n, v in self.rows)])
