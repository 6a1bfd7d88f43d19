"""TraceRecord: one served request as traces carry it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float  # seconds from the trace's start
    input_tokens: int
    output_tokens: int
    prefix_block_hashes: tuple[int, ...] = ()  # one per full block of the prompt, chained over the prefix
    block_tokens: int = 0  # tokens per hashed block (0 when there are no hashes)
    session_id: str | None = None
    ttft_s: float | None = None  # measured, in captured traces
    tpot_s: float | None = None
    e2e_s: float | None = None
    source: str = ""
    prompt_text: str | None = None  # only when the operator opts in to capturing text
    request_id: str | None = None  # the server's id for the request (its response's "id"), in captured traces

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {self.input_tokens}/{self.output_tokens}")
        if self.arrival_s != self.arrival_s or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.prefix_block_hashes and self.block_tokens <= 0:
            raise ValueError("block_tokens must be positive when prefix_block_hashes are given")
        object.__setattr__(self, "prefix_block_hashes", tuple(int(h) for h in self.prefix_block_hashes))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefix_block_hashes"] = list(self.prefix_block_hashes)
        for optional in ("prompt_text", "request_id"):
            if d[optional] is None:
                del d[optional]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TraceRecord":
        if not isinstance(d, dict):
            raise ValueError("a trace record must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        missing = {"arrival_s", "input_tokens", "output_tokens"} - set(d)
        if missing:
            raise ValueError(f"missing fields {sorted(missing)}")
        d = dict(d)
        for k in ("input_tokens", "output_tokens", "block_tokens"):
            if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool)):
                raise ValueError(f"{k} must be an integer, got {d[k]!r}")
        d["prefix_block_hashes"] = tuple(d.get("prefix_block_hashes") or ())
        return cls(**d)
