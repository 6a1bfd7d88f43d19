"""A served tensor-parallel group (``polyinf serve -tp N``): the API process is rank 0 (the leader). Before every
step its engine loop broadcasts the requests it added, the ones it aborted and the admin commands it took, and
every follower rank applies them in the same order, then steps with it. Control messages go over gloo (a CPU
group beside NCCL on GPUs). The weights' sharding and the per-layer all-reduces are engine/model/parallel.py's.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import ConfigError, VariantError
from engine.generated.isolation import secrets_withheld
from engine.core.llm_engine import LLMEngine
from engine.model.parallel import rank_device

CONTROL_TIMEOUT = timedelta(hours=1)  # a follower waits this long for the leader's next message
TICK_S = 600.0  # an idle leader sends an empty message this often, well within CONTROL_TIMEOUT


def _join(rank: int, tp: int, port: int, backend: str):
    """Joins the group; returns the group control messages travel on."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=CONTROL_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if backend == "nccl" else dist.group.WORLD


def ranks_command(engine, control, command: str, spec) -> object:
    """Runs an admin command (``swap`` to ``spec``, or ``rollback``) on this rank and agrees on the outcome with
    the others: if any rank failed, the ranks that switched switch back, so every rank keeps the same variant,
    and every rank raises VariantError naming the ranks that failed. Returns this rank's SwapReport. ``variant``:
    every rank's active variant id, in rank order."""
    if command == "variant":  # each rank's active variant, in rank order
        ids: list = [None] * dist.get_world_size()
        dist.all_gather_object(ids, engine.variant.variant_id, group=control)
        return ids
    previous = engine.previous_variant
    try:
        report, error = (engine.swap_variant(spec) if command == "swap" else engine.rollback()), None
    except Exception as e:  # noqa: BLE001 -- every rank must reach the agreement below
        report, error = None, f"{type(e).__name__}: {e}"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=control)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        if report is not None:
            engine.rollback()
            engine.previous_variant = previous
        raise VariantError("; ".join(failed))
    return report


def _follow(engine, control) -> None:
    """A follower rank's loop: each message from the leader applied as the leader applied it, then one step."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            return
        adds, aborts, commands = box[0]
        for rid, ids, params in adds:
            try:
                engine.add_request(ids, params, request_id=rid)
            except Exception:  # noqa: BLE001 -- the leader refused it too and told its client
                pass
        for rid in aborts:
            engine.abort(rid)
        for command, spec in commands:
            try:
                ranks_command(engine, control, command, spec)
            except VariantError:
                pass  # the leader reports it
        try:
            engine.step()
        except Exception:  # noqa: BLE001 -- as the leader: the batch that broke is failed, serving goes on
            for rid in list(engine._seqs):
                engine.abort(rid)


def watch_parent(parent: int) -> None:
    """A follower ends when the process that started it is gone (killed without telling it)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follower_main(rank: int, tp: int, port: int, backend: str, config, threads: int, parent: int) -> None:
    torch.set_num_threads(threads)
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    control = _join(rank, tp, port, backend)
    engine = LLMEngine(dataclasses.replace(config, device=rank_device(config.device, rank)))
    _follow(engine, control)
    dist.destroy_process_group()


class RankGroup:
    """Rank 0's side of a served tensor-parallel group: starts ranks 1..tp-1 (each loads its own shard), joins
    the group as rank 0 in this process, and carries the engine loop's messages to them (``send``) and admin
    commands across them (``command``). A rank that exits ends this process: a group missing a rank cannot
    serve, and the server's supervisor (or the router's) starts it again."""

    def __init__(self, tp: int, config) -> None:
        import torch.multiprocessing as mp

        device = config.device
        if device.startswith("cuda") and torch.cuda.device_count() < tp:
            raise ConfigError(f"tp={tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
        self.tp = tp
        backend = "nccl" if device.startswith("cuda") else "gloo"
        threads = max(1, torch.get_num_threads() // tp)  # this process's share of the cores, split
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_follower_main, args=(r, tp, port, backend, config, threads, os.getpid()),
                                  daemon=True, name=f"polyinf-rank{r}") for r in range(1, tp)]
        with secrets_withheld():  # the ranks serve; they need none of this process's keys
            for p in self.procs:
                p.start()
        self._closing = False
        threading.Thread(target=self._watch, daemon=True, name="rank-watch").start()
        torch.set_num_threads(threads)
        self.control = _join(0, tp, port, backend)

    def _watch(self) -> None:
        while not self._closing:
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._closing:
                    print(f"polyinf: tensor-parallel rank {r} exited (code {p.exitcode}); the group cannot serve "
                          "without it, stopping", file=sys.stderr, flush=True)
                    os._exit(1)
            time.sleep(0.5)

    def send(self, message) -> None:
        """``(adds, aborts, commands)`` to every follower, before the step they all take; None ends them."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def command(self, engine, command: str, spec):
        return ranks_command(engine, self.control, command, spec)

    def close(self) -> None:
        """Ends the followers (after ``send(None)`` from the loop) and leaves the group."""
        self._closing = True
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
