"""Traffic capture: every finished request appended as a TraceRecord to rotating JSONL files.

Each record is one line, flushed and fsynced when written, so a killed server loses nothing
it reported as finished. Rotation renames the full file (atomic on POSIX) and starts a new
one. A line cut short by a crash mid-write (no trailing newline) is detected and skipped on
read.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

from engine.serving.trace_record import TraceRecord

CURRENT = "capture-current.jsonl"


class CaptureWriter:
    def __init__(self, directory: str | Path, max_bytes: int = 16 * 1024**2, keep_prompt_text: bool = False) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.keep_prompt_text = keep_prompt_text
        self._lock = threading.Lock()
        self._seq = 0
        self._f = self._open()
        self.records_written = 0

    def _open(self):
        path = self.dir / CURRENT
        if path.is_file():  # a previous run may have died mid-line: drop the torn tail it left
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                with open(path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        return open(path, "ab")

    def write(self, record: TraceRecord) -> None:
        d = record.to_json()
        if not self.keep_prompt_text:
            d.pop("prompt_text", None)
        line = (json.dumps(d, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._f.write(line)
            self._f.flush()
            os.fsync(self._f.fileno())
            self.records_written += 1
            if self._f.tell() >= self.max_bytes:
                self._rotate()

    def _rotate(self) -> None:
        self._f.close()
        self._seq += 1
        name = f"capture-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{self._seq:04d}.jsonl"
        os.rename(self.dir / CURRENT, self.dir / name)
        self._f = self._open()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def capture_files(directory: str | Path) -> list[Path]:
    """Rotated files oldest first, then the current one."""
    d = Path(directory)
    rotated = sorted(p for p in d.glob("capture-*.jsonl") if p.name != CURRENT)
    return rotated + ([d / CURRENT] if (d / CURRENT).is_file() else [])


def read_capture_lines(path: str | Path) -> Iterator[tuple[int, dict | Exception]]:
    """(line number, parsed object or the error) for each line; a torn final line is skipped."""
    lines = Path(path).read_bytes().split(b"\n")
    # lines[-1] is what follows the last newline: empty, or a write cut short, which is skipped
    for lineno, raw in enumerate(lines[:-1], 1):
        if not raw.strip():
            continue
        try:
            yield lineno, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield lineno, ValueError(f"not a JSON line ({e})")


def read_capture_dir(directory: str | Path) -> list[TraceRecord]:
    out = []
    for path in capture_files(directory):
        for lineno, d in read_capture_lines(path):
            if isinstance(d, Exception):
                raise ValueError(f"{path}:{lineno}: {d}")
            out.append(TraceRecord.from_json(d))
    return out
