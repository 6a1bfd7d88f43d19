"""The tensor-core kernel's autotuned tiles kept with a benchmark's figures: ``with tiles_kept(out): ...`` writes
OUT/tile-table.json (kernels/linear/tile_table.py) at the end, an interrupted run too, when the run autotuned any
shape on a GPU; copied to kernels/linear/tiles/, it gives later runs on that device the same tiles."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path


def keep_tiles(out: Path) -> list[Path]:
    """The table written to ``out`` if anything was autotuned; best effort (it runs while a failure may be on its
    way out): a failure to write is printed, not raised."""
    qmma = sys.modules.get("kernels.linear.qmma_triton")
    if qmma is None:  # never imported: nothing autotuned (and no Triton import on a CPU run's way out)
        return []
    try:
        paths = qmma.save_autotuned_tiles(out)
    except Exception as e:
        print(f"tile table not written to {out}: {type(e).__name__}: {e}", flush=True)
        return []
    for p in paths:
        print(f"tile table: {p}", flush=True)
    return paths


@contextlib.contextmanager
def tiles_kept(out: Path) -> Iterator[None]:
    try:
        yield
    finally:
        keep_tiles(out)
