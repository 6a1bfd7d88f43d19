"""The bounded set of row counts a ``concat`` workload's batch is padded to, so that compiled code and captured CUDA
graphs see few shapes: a concatenated batch's rows (a forecaster's series, a protein graph's nodes and edges)
follow its requests' sizes and take a new value almost every batch.

The grid has ``per_octave`` values in each octave above 2 * ``per_octave`` (every count below): with the default
four, m * 2^k for m in {4, 5, 6, 7}, i.e. 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... A count rounds up to the next
grid value, which adds less than 1 / ``per_octave`` of it (the worst case is one past a power of two,
4 * 2^k + 1 -> 5 * 2^k), and 1..4096 map onto 44 values (13 with one per octave, the powers of two).
"""
from __future__ import annotations

PER_OCTAVE = 4  # grid values per octave by default: at most a quarter of a batch's rows are padding


def padded_count(n: int, per_octave: int = PER_OCTAVE) -> int:
    """The smallest grid value >= ``n`` (module docstring): a multiple of the power of two that cuts ``n``'s
    octave into ``per_octave`` steps (a power of two itself); ``n`` itself up to 2 * ``per_octave``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a row count must be a non-negative integer, got {n!r}")
    if isinstance(per_octave, bool) or not isinstance(per_octave, int) or per_octave < 1 \
            or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave!r}")
    # n lies in the octave (2^j, 2^(j+1)], j = bit_length(n - 1) - 1; a step of 2^j / per_octave (at least 1)
    step = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
    return -(-n // step) * step


def check_target(what: str, have: int, target: int) -> None:
    """Raises when a batch of ``have`` rows is asked to pad down to ``target``."""
    if target < have:
        raise ValueError(f"cannot pad a batch of {have} {what} to {target}: the target must be at least the "
                         f"batch's own count")
