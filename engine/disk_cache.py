"""What the engine keeps on disk between processes: a folder per kind under ``$POLYINF_CACHE`` (default
``~/.cache/polyinf``), entries keyed by what they were derived from, written whole or not at all."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    return Path(os.environ.get("POLYINF_CACHE", Path.home() / ".cache" / "polyinf"))


def file_key(path: Path) -> str:
    """A file's identity: its resolved path, size and modification time (a new version is a new key)."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def keep(path: Path, write: Callable[[Path], object]) -> bool:
    """``write(tmp)`` fills a file beside ``path``, renamed onto it once whole (a reader never sees half of it);
    False when it could not be written (a read-only home, a full disk): the cache only saves work."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return True
    except Exception:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
