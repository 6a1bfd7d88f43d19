"""One request as the engine tracks it: its tokens, its blocks, how far it has been computed."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.config.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS, a stop token id, or a stop string


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; preemption takes the latest arrival first
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose KV is in the cache. Reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    # Of the prompt, how many tokens came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_tokens_run: int = 0  # tokens of this sequence run through the model, recompute included
    output_text: str = ""
    first_token_time: float | None = None
    spec: Any = None  # engine.sched.speculation.SpecState while the active variant speculates
    logprobs: list = field(default_factory=list)  # with params.logprobs: (token, logprob, top) per output token

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
