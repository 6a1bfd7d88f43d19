"""Continuous batching: which sequences run in the next step, and how many tokens each.

Running sequences go first (decodes and unfinished prefill chunks), oldest first; then
waiting sequences are admitted while the token budget, ``max_num_seqs`` and free
blocks allow. A prompt longer than the remaining budget (or than the prefill chunk
size) is prefilled in chunks over several steps. When a running sequence needs a
block and none is free, the most recently admitted sequence is preempted: its blocks
are freed and it is recomputed later from its tokens so far.
"""
from __future__ import annotations

from collections import deque

from engine.sched import speculation
from engine.sched.block_manager import BlockManager
from engine.sched.output import ScheduledSequence, SchedulerOutput
from engine.sched.sequence import Sequence, SequenceStatus
from engine.config.variant import VariantSpec


class Scheduler:
    def __init__(self, config: VariantSpec, block_manager: BlockManager, max_model_len: int | None = None) -> None:
        self.config = config  # the active variant: max_num_seqs, max_num_batched_tokens, prefill_chunk_size
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_model_len = max_model_len  # a draft never runs past the context

    def reconfigure(self, config: VariantSpec | None = None, block_manager: BlockManager | None = None) -> None:
        """A swap's new knobs (taking effect at the next step) and, after a KV-layout change, the new pool's
        block manager (every sequence was preempted first)."""
        if config is not None:
            self.config = config
        if block_manager is not None:
            self.block_manager = block_manager

    def continues(self, rows: list) -> bool:
        """Whether the step after ``rows`` (a step's scheduled items) is known before their tokens are: nothing
        waiting for admission, every running sequence among them, each a one-token decode row, and no draft the
        next step might propose. The engine then launches it ahead (LLMEngine._can_run_ahead); the simulator
        (ops/predict/cost_model.simulate) follows the same rule."""
        v = self.config
        if self.waiting or len(rows) != len(self.running):
            return False
        if v.speculative_tokens > 0 and len(rows) <= v.speculative_max_batch:
            return False  # the next step may draft: it goes through the scheduler
        return all(item.num_new_tokens == 1 and item.samples for item in rows)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        limit = budget if remaining <= 1 or self.config.prefill_chunk_size is None else min(
            budget, self.config.prefill_chunk_size
        )
        return min(remaining, limit)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            while not bm.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the most recently admitted; never one scheduled already
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
                budget -= n
                i += 1
        if out.preempted:
            return out  # blocks are short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            n = self._chunk(seq, budget)
            if not bm.ensure_slots(seq, seq.num_computed_tokens + n):
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n
        if self.config.speculative_tokens > 0:
            self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts for the step's decoding rows, from what the step leaves over: budget after every running and
        admitted row, and free blocks (a draft never preempts or holds back anyone)."""
        for idx, item in enumerate(out.scheduled):
            if budget <= 0:
                break
            if not (item.samples and item.num_new_tokens == 1):
                continue
            draft = self._draft(item.seq, budget)
            if draft:
                out.scheduled[idx] = ScheduledSequence(item.seq, 1 + len(draft), True, draft)
                budget -= len(draft)

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """A prompt-lookup draft for the decoding ``seq`` that fits the budget, its context, its max_tokens and
        the free blocks; () when it should not speculate."""
        bm = self.block_manager
        slots = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_tokens  # own and free slots
        room = min(budget, seq.params.max_tokens - len(seq.output_token_ids) - 1, slots)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens)
        draft = speculation.draft_for(seq, self.config, len(self.running), room)
        if not draft or not bm.ensure_slots(seq, seq.num_tokens + len(draft)):
            return ()
        return tuple(draft)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        out.preempted.append(seq)
        # Back to the front of the queue, keeping arrival order among the preempted.
        self.waiting.appendleft(seq)
        if len(self.waiting) > 1 and self.waiting[0].arrival > self.waiting[1].arrival:
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.arrival))

    def preempt_all(self) -> None:
        """Sends every running sequence back to the queue to be recomputed (e.g. after the KV pool changes)."""
        out = SchedulerOutput()
        for seq in sorted(self.running, key=lambda s: -s.arrival):
            self._preempt(seq, out)

    def update(self, batch: SchedulerOutput, new_tokens: dict[str, list[int]], check_stop) -> None:
        """Takes a step's results: each scheduled sequence advances by its tokens; where the step sampled, its
        tokens (one, or a verified draft's accepted tokens and one more) are appended one at a time, each
        followed by ``check_stop(seq)``, which sets the finish reason; full blocks are committed to the prefix
        cache; blocks holding only rejected draft positions are released; finished sequences release their
        blocks. The engine and the cost model's simulation both advance sequences here."""
        for item in batch.scheduled:
            seq = item.seq
            seq.num_tokens_run += item.num_new_tokens
            if item.samples:
                emitted = 0
                for tok in new_tokens[seq.request_id]:
                    seq.output_token_ids.append(tok)
                    emitted += 1
                    check_stop(seq)
                    if seq.finish_reason is not None:
                        break
                # the last token and the accepted draft tokens are computed; the rejected ones are not
                seq.num_computed_tokens += item.num_new_tokens - len(item.draft) + emitted - 1
            else:
                seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if seq.finish_reason is not None:
                self.finish(seq)
            elif item.draft:
                self.block_manager.trim(seq, seq.num_tokens)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
