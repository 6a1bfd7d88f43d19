"""The engine behind the server: one thread runs the step loop; requests arrive from any thread.

Each request gets an asyncio queue in the caller's event loop; the loop thread pushes every
new RequestOutput into it. Requests are validated in the caller's thread (so a bad request is
refused at once) and added and aborted by the loop thread, which alone touches the engine's
scheduler. Finished requests are counted in the metrics and appended to the capture.

With a tensor-parallel group (``ranks``, engine/model/parallel.py's RankGroup) this engine is rank 0's: before each
step the loop sends the follower ranks what it added, aborted and swapped, so every rank steps alike; admin
swaps and rollbacks then run in the loop, on every rank at the same step boundary.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from dataclasses import dataclass

from engine.sched.block_manager import chain_hash
from engine.serving.capture import CaptureWriter
from engine.core.llm_engine import LLMEngine, RequestOutput
from engine.serving.metrics import EngineMetrics
from engine.serving.rank_group import TICK_S
from engine.config.sampling_params import SamplingParams
from engine.serving.trace_record import TraceRecord
from engine.config.variant import VariantSpec
from engine.core.variant_swap import SwapReport


@dataclass
class _Tracked:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    prompt_ids: list[int]
    arrival: float
    prompt_text: str | None = None
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None,
                 capture: CaptureWriter | None = None, ranks=None) -> None:
        self.engine = engine
        self.ranks = ranks
        self.metrics = metrics or EngineMetrics()
        self.capture = capture
        self.start_time = time.time()
        self._cond = threading.Condition()
        self._pending: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._commands: list[tuple[str, VariantSpec | None, concurrent.futures.Future]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._tick = TICK_S if ranks is not None else None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from request handlers -----------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, prompt_text: str | None = None,
               request_id: str | None = None) -> tuple[str, asyncio.Queue]:
        """Validates and queues a request; raises RequestError at once if it cannot be served. ``request_id``
        (unique, e.g. the response's id) is what the capture records; default a fresh one."""
        self.engine.validate(prompt_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            self._tracked[rid] = _Tracked(queue, loop, prompt_ids, time.time(), prompt_text)
            self._pending.append((rid, prompt_ids, params))
            self._cond.notify()
        return rid, queue

    def abort(self, rid: str) -> None:
        with self._cond:
            self._aborts.append(rid)
            self._cond.notify()

    def swap_variant(self, spec: VariantSpec) -> SwapReport:
        """Makes ``spec`` active (blocking; call it off the event loop). One rank: prepared in this thread while
        the loop serves, switched between two steps. A tensor-parallel group: on every rank at one step
        boundary, all switched or none."""
        return self.engine.swap_variant(spec) if self.ranks is None else self._command("swap", spec)

    def rollback(self) -> SwapReport:
        return self.engine.rollback() if self.ranks is None else self._command("rollback", None)

    def rank_variants(self) -> list[str]:
        """Every rank's active variant id, in rank order (one rank: this engine's)."""
        return [self.engine.variant.variant_id] if self.ranks is None else self._command("variant", None)

    def _command(self, command: str, spec: VariantSpec | None):
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._commands.append((command, spec, done))
            self._cond.notify()
        return done.result()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not (self._stop or self._pending or self._aborts or self._commands or eng.has_unfinished()):
                    if not self._cond.wait(timeout=self._tick) and self.ranks is not None:
                        break  # an idle group's followers hear from the leader now and then
                if self._stop:
                    if self.ranks is not None:
                        self.ranks.send(None)
                    return
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
                commands, self._commands = self._commands, []
            if self.ranks is not None:
                self.ranks.send((pending, aborts, [(c, s) for c, s, _ in commands]))
            for rid, ids, params in pending:
                try:
                    eng.add_request(ids, params, request_id=rid)
                except Exception as e:  # this request alone fails; the loop goes on serving the others
                    self._deliver(rid, e)
            try:
                for rid in aborts:
                    eng.abort(rid)
                    self._tracked.pop(rid, None)
                for command, spec, done in commands:
                    try:
                        done.set_result(self.ranks.command(eng, command, spec))
                    except Exception as e:  # noqa: BLE001 -- the admin call that asked gets it
                        done.set_exception(e)
                outputs = eng.step()
            except Exception as e:  # keep serving the ones that can be; fail the batch that broke
                self.error = e
                for rid in list(self._tracked):
                    eng.abort(rid)
                    self._deliver(rid, e)
                continue
            now = time.time()
            for out in outputs:
                try:
                    self._on_output(out, now)
                except Exception as e:  # e.g. the capture's disk is full: the request is answered, the loop lives
                    self.error = e
                    self._deliver(out.request_id, out)
            self._update_gauges()

    def _on_output(self, out: RequestOutput, now: float) -> None:
        t = self._tracked.get(out.request_id)
        if t is None:
            return  # aborted meanwhile
        new = len(out.token_ids) - t.tokens
        if new > 0:
            if t.first_token is None:
                t.first_token = now
                self.metrics.ttft.observe(now - t.arrival)
            elif t.last_token is not None:
                for _ in range(new):  # a verified draft emits several tokens in one step: each gets its share
                    self.metrics.itl.observe((now - t.last_token) / new)
            t.last_token = now
            t.tokens = len(out.token_ids)
        if out.finished:
            self._tracked.pop(out.request_id, None)
            self._finish(out, t, now)
        self._deliver(out.request_id, out, t)

    def _finish(self, out: RequestOutput, t: _Tracked, now: float) -> None:
        m = self.metrics
        m.e2e.observe(now - t.arrival)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(len(out.token_ids))
        m.request_success.labels(finished_reason=out.finish_reason or "unknown").inc()
        if self.capture is not None:
            n = len(out.token_ids)
            ttft = (t.first_token - t.arrival) if t.first_token else None
            self.capture.write(TraceRecord(
                arrival_s=max(0.0, t.arrival - self.start_time), input_tokens=len(out.prompt_token_ids),
                output_tokens=n, prefix_block_hashes=prefix_hashes(out.prompt_token_ids, self.engine.kv.block_size),
                block_tokens=self.engine.kv.block_size, ttft_s=ttft,
                tpot_s=((now - t.first_token) / (n - 1)) if t.first_token and n > 1 else None,
                e2e_s=now - t.arrival, source="capture", prompt_text=t.prompt_text, request_id=out.request_id,
            ))

    def _deliver(self, rid: str, item, t: _Tracked | None = None) -> None:
        t = t or self._tracked.pop(rid, None)
        if t is not None:
            t.loop.call_soon_threadsafe(t.queue.put_nowait, item)

    def _update_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        m.running.set(len(eng.scheduler.running))
        m.waiting.set(len(eng.scheduler.waiting))
        m.kv_usage.set(eng.block_manager.usage())
        stats = eng.block_manager.stats
        m.sync_prefix_cache(stats.queries, stats.hits)
        es = eng.stats
        m.sync_speculation(es.spec_drafts, es.spec_draft_tokens, es.spec_accepted_tokens, es.spec_accepted_per_pos)
        m.sync_preemptions(es.preemptions)
        m.set_variant(eng.variant.variant_id, eng.variant.name)


def prefix_hashes(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks, as 63-bit integers (the capture format)."""
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(int.from_bytes(parent[:8], "big") >> 1)
    return tuple(out)
