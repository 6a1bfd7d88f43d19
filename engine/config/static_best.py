"""Static-best: the engine's default form for a model on a device.

It is found once, without seeing any deployment's traffic, by a sweep on that hardware over a fixed
synthetic workload (ops/measure/static_best_sweep.py: kernels, CUDA graphs and knobs at the checkpoint's own
precision, ranked by capacity at an SLO), and recorded here per (model, device, dtype) with the sweep
that chose it, in engine/data/static_best.json. Engines built without an explicit variant start from
it, so users get it without tuning; every tuned figure is a ratio against it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from engine.config.source import ModelSource
from engine.config.variant import VariantSpec

PATH = Path(__file__).resolve().parents[1] / "data" / "static_best.json"


def model_name(source: ModelSource) -> str:
    """A model's name in the record: its file or folder name (a GGUF file's stem, a preset's name)."""
    return source.path.stem if source.path.suffix in (".gguf", ".json") else source.path.name


def device_label(device: str) -> str:
    """``cpu``, or the GPU's model name (e.g. ``NVIDIA H200``): static-best is per kind of hardware."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def _path() -> Path:
    return Path(os.environ.get("POLYINF_STATIC_BEST", PATH))


def read_entries(path: Path) -> list[dict]:
    """The entries of a static-best record file (this one, or a workload's: engine/workloads/static_best.py); none
    when it does not exist; a corrupt file is an error that names it."""
    try:
        return json.loads(path.read_text())["entries"]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a static-best record ({type(e).__name__}: {e}); fix or remove it "
                         "(a new sweep writes a new one)") from e


def write_entries(path: Path, entries: list[dict], key) -> Path:
    """Writes ``entries`` sorted by ``key`` to ``path`` whole (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"entries": sorted(entries, key=key)}, indent=1) + "\n")
    tmp.replace(path)
    return path


def entries() -> list[dict]:
    return read_entries(_path())


def lookup(source: ModelSource, device: str, dtype: str) -> VariantSpec | None:
    """The recorded static-best variant for this model, device and dtype; on a GPU without an entry of its own,
    the same model's on another GPU (named so); or None."""
    key = (model_name(source), device_label(device), dtype)
    found = entries()
    for e in found:
        if (e["model"], e["device"], e["dtype"]) == key:
            return VariantSpec.from_json({**e["variant"], "name": "static-best"})
    if key[1] != "cpu":  # a GPU without its own sweep: another GPU's static-best is a far stronger baseline than
        # the engine's plain default (the name says where it was found; `polyinf static-best --write` records one)
        for e in found:
            if (e["model"], e["dtype"]) == (key[0], dtype) and e["device"] != "cpu":
                return VariantSpec.from_json({**e["variant"], "name": f"static-best (recorded on {e['device']})"})
    return None


def record(source: ModelSource, device: str, dtype: str, variant: VariantSpec, sweep: dict) -> Path:
    """Records (or replaces) the entry for this model, device and dtype, with the sweep that chose it."""
    key = (model_name(source), device_label(device), dtype)
    kept = [e for e in entries() if (e["model"], e["device"], e["dtype"]) != key]
    body = {k: v for k, v in variant.to_json().items() if k not in ("name", "variant_id")}
    kept.append({"model": key[0], "device": key[1], "dtype": dtype, "variant": body, "sweep": sweep})
    return write_entries(_path(), kept, key=lambda e: (e["model"], e["device"], e["dtype"]))
