"""Tables of the tensor-core kernel's tiles (kernels/linear/qmma_triton.py) per device, on disk, so that a device
takes the same tiles in every run and a model's first preparation need not time ~30 candidates per shape.

A table is a JSON file named ``<device slug>.triton-<major.minor>.json`` (``table_name``: ``torch.cuda.
get_device_name()`` lowered, each run of other characters a ``-``; e.g. ``nvidia-h100-80gb-hbm3.triton-3.6.json``),
in ``kernels/linear/tiles/`` and, optionally, at the path the environment variable ``POLYINF_TILE_TABLE`` names
(read first: its entries win; a process that autotunes a shape adds it there). One JSON object::

    {"about": "...",                 # optional: free text
     "device": "NVIDIA H100 80GB HBM3",  # torch.cuda.get_device_name(), as measured
     "triton": "3.6",                # Triton's major.minor
     "entries": [{"block_m": 16,     # the call's rows rounded up to a power of two, at least 16 (at most 64)
                  "n": 6144, "k": 4096,  # the weight's shape (out, in) as stored
                  "kind": "fp8",     # the weight's format: "fp8" or "int8"
                  "prologue": 2,     # 0 none, 1 SiLU-and-multiply, 2 residual add + RMSNorm
                  "pdl": 1,          # optional, informational: the PDL level the tiles were timed at
                  "tiles": {"block_n": 64, "block_k": 256, "split_k": 2, "num_warps": 4, "num_stages": 4,
                            "fused": 1},  # all six, positive ints (fused 0 or 1)
                  "ms": 0.0143}]}    # the tiles' time per call when they were chosen, L2 flushed

The lookup key is (block_m, n, k, kind, prologue), as the in-process choice's (``TileChoices``): ``pdl`` is
recorded but not matched, as before tables: a shape's tiles are timed once, at the first call's PDL level. A
missing file is an empty table; a malformed one, or an entry with invalid tiles, raises ``TileTableError`` naming
the file (a committed table is never silently autotuned over). Files are written whole (a temporary file, then
``os.replace``). Pure Python: the device's name comes from the caller, so all of it runs without a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "tiles"  # the committed tables
# a device with no committed table of its own takes its sibling's: the same architecture and SM count (H100 SXM
# and H200: sm_90, 132 SMs; the H200 has more memory bandwidth), so the sibling's tiles are a fixed, near choice,
# the same in every run, where autotuning would cost minutes of each session's first preparation (227 s on an H100)
SIBLINGS = {"nvidia-h100-80gb-hbm3": "nvidia-h200"}
ENV = "POLYINF_TILE_TABLE"  # an extra table: read first, extended by autotuning
TILE_FIELDS = ("block_n", "block_k", "split_k", "num_warps", "num_stages", "fused")
POWERS_OF_TWO = ("block_n", "block_k", "num_warps")  # tl.arange's and the launch's
KINDS = ("fp8", "int8")
PROLOGUES = (0, 1, 2)  # kernels/linear/qmma_triton.py's NONE, SILU_MUL, ADD_RMS_NORM
_ENTRY_FIELDS = {"block_m", "n", "k", "kind", "prologue", "pdl", "tiles", "ms"}
_TABLE_FIELDS = {"about", "device", "triton", "entries"}
ABOUT = ("Tiles of kernels/linear/qmma_triton.py per (block_m, n, k, kind, prologue) on this device and Triton "
         "version; the format: kernels/linear/tile_table.py.")


class TileTableError(ValueError):
    """A tile table that cannot be used: malformed JSON, a wrong field, another device's table. Names the file."""


@dataclasses.dataclass(frozen=True)
class TileKey:
    """What a shape's tiles are chosen for."""
    block_m: int  # the call's rows rounded up to a power of two, at least 16
    n: int  # the weight's rows (outputs)
    k: int  # the weight's columns as stored
    kind: str  # "fp8" or "int8"
    prologue: int  # PROLOGUES


@dataclasses.dataclass(frozen=True)
class TileEntry:
    """A shape's tiles and where they came from."""
    key: TileKey
    tiles: dict  # TILE_FIELDS -> int
    ms: float  # their time per call when chosen
    pdl: int | None = None  # the PDL level they were timed at (informational)
    autotuned: bool = False  # timed in this process (else read from a table)

    def to_json(self) -> dict:
        out = {**dataclasses.asdict(self.key), "tiles": {f: self.tiles[f] for f in TILE_FIELDS}, "ms": self.ms}
        if self.pdl is not None:
            out["pdl"] = self.pdl
        return out


def device_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def triton_minor(version: str) -> str:
    """'3.6.0' -> '3.6'."""
    return ".".join(version.split(".")[:2])


def current_triton() -> str:
    import triton

    return triton_minor(triton.__version__)


def table_name(device_name: str, triton: str) -> str:
    """The table's file name for a device and Triton's major.minor."""
    return f"{device_slug(device_name)}.triton-{triton}.json"


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def validate_tiles(tiles, where: str) -> dict:
    """``tiles`` checked: exactly TILE_FIELDS, positive ints, ``fused`` 0 or 1, block sizes and warps powers of
    two; else TileTableError saying ``where``."""
    if not isinstance(tiles, dict):
        raise TileTableError(f"{where}: tiles must be an object, got {tiles!r}")
    unknown, missing = sorted(set(tiles) - set(TILE_FIELDS)), [f for f in TILE_FIELDS if f not in tiles]
    if unknown or missing:
        raise TileTableError(f"{where}: tiles {tiles!r}: unknown keys {unknown}, missing keys {missing}")
    for f in TILE_FIELDS:
        v = tiles[f]
        ok = v in (0, 1) and not isinstance(v, bool) and isinstance(v, int) if f == "fused" else _positive_int(v)
        if not ok or (f in POWERS_OF_TWO and v & (v - 1)):
            want = "0 or 1" if f == "fused" else "a positive int" + (", a power of two" if f in POWERS_OF_TWO else "")
            raise TileTableError(f"{where}: tiles {f}={v!r}: must be {want}")
    return dict(tiles)


def _entry(obj, where: str) -> TileEntry:
    if not isinstance(obj, dict):
        raise TileTableError(f"{where}: must be an object, got {obj!r}")
    unknown = sorted(set(obj) - _ENTRY_FIELDS)
    missing = sorted(_ENTRY_FIELDS - {"pdl"} - set(obj))
    if unknown or missing:
        raise TileTableError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    bm, n, k, kind, prologue, ms, pdl = (obj.get(f) for f in ("block_m", "n", "k", "kind", "prologue", "ms", "pdl"))
    if not _positive_int(bm) or bm < 16 or bm & (bm - 1):
        raise TileTableError(f"{where}: block_m={bm!r}: must be a power of two, at least 16")
    for name, v in (("n", n), ("k", k)):
        if not _positive_int(v):
            raise TileTableError(f"{where}: {name}={v!r}: must be a positive int")
    if kind not in KINDS:
        raise TileTableError(f"{where}: kind={kind!r}: must be one of {KINDS}")
    if isinstance(prologue, bool) or prologue not in PROLOGUES:
        raise TileTableError(f"{where}: prologue={prologue!r}: must be one of {PROLOGUES}")
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise TileTableError(f"{where}: ms={ms!r}: must be a finite number >= 0")
    if pdl is not None and (isinstance(pdl, bool) or not isinstance(pdl, int) or pdl < 0):
        raise TileTableError(f"{where}: pdl={pdl!r}: must be an int >= 0")
    return TileEntry(TileKey(bm, n, k, kind, prologue), validate_tiles(obj["tiles"], where), float(ms), pdl)


def parse_table(obj, where: str, device_name: str | None = None, triton: str | None = None
                ) -> dict[TileKey, TileEntry]:
    """A table's JSON object, checked (the device and Triton version too, when given) -> its entries by key."""
    if not isinstance(obj, dict):
        raise TileTableError(f"{where}: a tile table must be a JSON object")
    unknown = sorted(set(obj) - _TABLE_FIELDS)
    if unknown or not isinstance(obj.get("device"), str) or not isinstance(obj.get("triton"), str) or not isinstance(
            obj.get("entries"), list):
        raise TileTableError(f"{where}: a tile table is {{'device': str, 'triton': str, 'entries': [...]}} "
                             f"(and an optional 'about'); unknown fields {unknown}")
    if device_name is not None and device_slug(obj["device"]) != device_slug(device_name):
        raise TileTableError(f"{where}: the tiles of {obj['device']!r}, not of this device ({device_name!r})")
    if triton is not None and obj["triton"] != triton:
        raise TileTableError(f"{where}: the tiles of Triton {obj['triton']}, not of this one ({triton})")
    out: dict[TileKey, TileEntry] = {}
    for i, e in enumerate(obj["entries"]):
        entry = _entry(e, f"{where}: entry {i}")
        if entry.key in out:
            raise TileTableError(f"{where}: entry {i}: a second entry for {entry.key}")
        out[entry.key] = entry
    return out


def read_table(path: Path, device_name: str | None = None, triton: str | None = None) -> dict[TileKey, TileEntry]:
    """The table at ``path`` by key (empty if there is no file); TileTableError naming the file if it is
    unreadable, malformed or another device's or Triton version's."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise TileTableError(f"{path}: cannot read the tile table: {e}") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TileTableError(f"{path}: not a JSON tile table: {e}") from e
    return parse_table(obj, str(path), device_name, triton)


def table_json(device_name: str, triton: str, entries) -> dict:
    """The JSON object of a table of ``entries`` (TileEntry), sorted by key."""
    order = sorted(entries, key=lambda e: (e.key.kind, e.key.prologue, e.key.n, e.key.k, e.key.block_m))
    return {"about": ABOUT, "device": device_name, "triton": triton, "entries": [e.to_json() for e in order]}


def write_table(path: Path, obj: dict) -> Path:
    """``obj`` (a table's JSON object, checked first) written to ``path`` whole: a temporary file beside it,
    then os.replace. One entry a line, so that a table's changes read as a diff."""
    path = Path(path)
    parse_table(obj, str(path))
    head = {k: v for k, v in obj.items() if k != "entries"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    body = ",\n".join(f"  {json.dumps(e)}" for e in obj["entries"])
    text = "{\n" + "\n".join(lines) + '\n "entries": [\n' + body + ("\n" if body else "") + " ]\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def extra_table() -> Path | None:
    """The file POLYINF_TILE_TABLE names, if set."""
    p = os.environ.get(ENV)
    return Path(p) if p else None


class TileChoices:
    """This process's tiles per device name and key: autotuned here or read from the device's tables.

    Invariants: a key's tiles, once chosen for a device name, are the ones every later call on a device of that
    name gets (each card of a model alike); a device name's tables are read once (per POLYINF_TILE_TABLE value)."""

    def __init__(self, folder: Path = FOLDER, triton: str | None = None) -> None:
        self.folder = Path(folder)
        self.triton = triton or current_triton()
        self._chosen: dict[str, dict[TileKey, TileEntry]] = {}  # device name -> key -> entry
        self._tables: dict[tuple[str, Path | None], dict[TileKey, TileEntry]] = {}

    def table(self, device_name: str) -> dict[TileKey, TileEntry]:
        """The device's tables merged: the committed one (its SIBLINGS' where it has none), then the extra
        file's entries over it."""
        extra = extra_table()
        if (device_name, extra) not in self._tables:
            own = self.folder / table_name(device_name, self.triton)
            sibling = SIBLINGS.get(device_slug(device_name))
            if not own.exists() and sibling and (self.folder / table_name(sibling, self.triton)).exists():
                t = read_table(self.folder / table_name(sibling, self.triton), sibling, self.triton)
            else:
                t = read_table(own, device_name, self.triton)
            if extra is not None:
                t.update(read_table(extra, device_name, self.triton))
            self._tables[device_name, extra] = t
        return self._tables[device_name, extra]

    def choose(self, device_name: str, key: TileKey, autotune: Callable[[], TileEntry]) -> TileEntry:
        """The key's tiles: chosen before, else the device's table's, else ``autotune()`` (then written to the
        file POLYINF_TILE_TABLE names, if set)."""
        chosen = self._chosen.setdefault(device_name, {})
        entry = chosen.get(key)
        if entry is None:
            entry = self.table(device_name).get(key)
            if entry is None:
                entry = dataclasses.replace(autotune(), key=key, autotuned=True)
            chosen[key] = entry
            extra = extra_table()
            if entry.autotuned and extra is not None:
                self.save(extra, device_name)
        return entry

    def entries(self, device_name: str) -> list[TileEntry]:
        return list(self._chosen.get(device_name, {}).values())

    def autotuned_devices(self) -> list[str]:
        """The device names this process autotuned any key on."""
        return [d for d, c in self._chosen.items() if any(e.autotuned for e in c.values())]

    def to_json(self, device_name: str) -> dict:
        """What this process chose on ``device_name``, as a table's JSON object."""
        return table_json(device_name, self.triton, self.entries(device_name))

    def save(self, path: Path, device_name: str) -> Path:
        """This process's choices on ``device_name`` written to ``path``, over the entries for other keys that the
        file holds already (TileTableError if it holds another device's or Triton version's)."""
        merged = {**read_table(path, device_name, self.triton), **self._chosen.get(device_name, {})}
        return write_table(path, table_json(device_name, self.triton, merged.values()))

