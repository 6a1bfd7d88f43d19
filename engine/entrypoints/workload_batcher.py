"""The batcher in front of a WorkloadRunner: requests from the event loop wait in a bounded queue; one worker
thread takes the group the workload's batch policy would run first (the oldest request and those that may share
its forward pass), runs ``runner(group)`` and resolves each request's future with its own output.

Variant swaps and rollbacks go through the same thread, so they land between two batches, never during one; the
variants swapped away from are kept, newest last, for rollback. With ``warmup`` (requests to run right after an
install), a variant whose first pass fails (a compile error, say) is taken out again before any client request
reaches it: the previous variant stays. A batch that raises is run again one request at a
time, so one request's failure is only its own.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.workloads.variants import WorkloadRunner, WorkloadVariant
from engine.workloads.workload import WorkloadRequest


class QueueFull(Exception):
    """The queue holds as many requests as it may; the caller answers 503."""


class NoPrevious(Exception):
    """A rollback with no variant to go back to."""


@dataclass
class _Job:
    request: WorkloadRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Swap:
    variant: WorkloadVariant | None  # None: roll back to the previous one
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class Served:
    """What a request got back: its output, the variant that computed it and how many requests shared the pass."""

    output: object  # torch.Tensor, this request's rows only
    variant_id: str
    batch_size: int


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    sizes: collections.Counter = field(default_factory=collections.Counter)  # batch size -> batches


def _resolve(fut: asyncio.Future, loop: asyncio.AbstractEventLoop, result=None, error: BaseException | None = None):
    def done() -> None:
        if fut.done():  # the client went away and the handler cancelled it
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    loop.call_soon_threadsafe(done)


class WorkloadBatcher:
    def __init__(self, runner: WorkloadRunner, max_queue: int = 256, max_wait_s: float = 0.002,
                 on_batch=None, warmup: Callable[[], list[WorkloadRequest]] | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.runner, self.max_queue, self.max_wait_s = runner, max_queue, max_wait_s
        self.on_batch = on_batch  # called with each batch's size (the server's metrics)
        self.warmup = warmup
        self.history: list[WorkloadVariant] = []  # variants swapped away from, newest last
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._swaps: collections.deque[_Swap] = collections.deque()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="workload-batcher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return len(self._jobs)

    @property
    def previous(self) -> WorkloadVariant | None:
        return self.history[-1] if self.history else None

    def can_submit(self) -> bool:
        return len(self._jobs) < self.max_queue

    def submit(self, request: WorkloadRequest) -> asyncio.Future:
        """A future of the request's ``Served``; raises QueueFull when the queue is full."""
        loop = asyncio.get_running_loop()
        job = _Job(request, loop.create_future(), loop)
        with self._cond:
            if not self.can_submit():
                raise QueueFull(f"{len(self._jobs)} requests are queued (the most this server holds)")
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def swap(self, variant: WorkloadVariant | None) -> asyncio.Future:
        """A future of the variant active after the swap (``None``: roll back); it fails with the runner's
        ValueError (a refused variant, the previous one stays) or NoPrevious."""
        loop = asyncio.get_running_loop()
        op = _Swap(variant, loop.create_future(), loop)
        with self._cond:
            self._swaps.append(op)
            self._cond.notify()
        return op.future

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- the worker thread ----------------------------------------------------------------------
    def _take(self) -> tuple[list[_Swap], list[_Job]]:
        """Swaps waiting, else the next batch: waits up to ``max_wait_s`` for it to fill when it is not full."""
        with self._cond:
            while not (self._stop or self._jobs or self._swaps):
                self._cond.wait()
            if self._swaps or self._stop:
                swaps = list(self._swaps)
                self._swaps.clear()
                return swaps, []
            deadline = time.monotonic() + self.max_wait_s
            while len(self._jobs) < self._cap() and not self._swaps and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._swaps:  # a swap goes first; the batch is taken on the next round
                swaps = list(self._swaps)
                self._swaps.clear()
                return swaps, []
            policy = self.runner.workload.batch
            first = policy.plan([j.request.size for j in self._jobs], self._cap())[0]
            picked = set(first)
            jobs = [j for i, j in enumerate(self._jobs) if i in picked]
            self._jobs = collections.deque(j for i, j in enumerate(self._jobs) if i not in picked)
            return [], jobs

    def _cap(self) -> int:
        v = self.runner.variant
        cap = v.max_batch or self.runner.workload.batch.max_batch
        return min(cap, v.bucket_sizes[-1]) if v.bucket_sizes else cap

    def _loop(self) -> None:
        while True:
            swaps, jobs = self._take()
            for op in swaps:
                self._apply(op)
            if jobs:
                self._run(jobs)
            if self._stop and not jobs:
                with self._cond:
                    left, self._jobs = list(self._jobs), collections.deque()
                for j in left:
                    _resolve(j.future, j.loop, error=RuntimeError("the server is shutting down"))
                return

    def _apply(self, op: _Swap) -> None:
        try:
            before = self.runner.variant
            if op.variant is None:
                if not self.history:
                    raise NoPrevious("no previous variant to roll back to")
                self.runner.install(self.history[-1])
                self.history.pop()
            else:
                self.runner.install(op.variant)
                if self.warmup is not None:
                    try:
                        self.runner(self.warmup())
                    except Exception as e:
                        self.runner.install(before)
                        raise ValueError(f"its first forward pass failed ({type(e).__name__}: {e})") from e
                self.history.append(before)
            _resolve(op.future, op.loop, self.runner.variant)
        except Exception as e:  # noqa: BLE001 - the swap's caller gets it; the worker goes on
            _resolve(op.future, op.loop, error=e)

    def _run(self, jobs: list[_Job]) -> None:
        variant_id = self.runner.variant.variant_id
        try:
            outs = self.runner([j.request for j in jobs])
        except Exception as e:  # noqa: BLE001 - isolate the request that fails: each alone
            if len(jobs) > 1:
                for j in jobs:
                    self._run([j])
            else:
                _resolve(jobs[0].future, jobs[0].loop, error=e)
            return
        self.stats.batches += 1
        self.stats.requests += len(jobs)
        self.stats.sizes[len(jobs)] += 1
        if self.on_batch is not None:
            self.on_batch(len(jobs))
        for j, o in zip(jobs, outs):
            _resolve(j.future, j.loop, Served(o, variant_id, len(jobs)))

