"""What the scheduler hands the model runner for one step: the sequences scheduled, how many tokens each, and
the sequences preempted. A leaf module: the runner reads it without importing the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for this sequence in this step
    samples: bool  # the step reaches the end of the sequence's tokens, so a token is sampled
    # prompt-lookup draft run after the sequence's last token (num_new_tokens = 1 + len(draft)); logits are read
    # at every one of those positions and the draft verified (engine/sched/speculation.py)
    draft: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # preempted in this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
