"""Tensor parallelism: each rank holds a slice of every layer, and two all-reduces join them per layer.

Attention is split by heads (each rank holds ``H / tp`` query heads and ``KVH / tp`` KV heads, so
its KV cache holds only those), the MLP by intermediate columns (an MoE layer: every expert's
intermediate columns), the lm_head by vocabulary rows, gathered into whole logits. The outputs
of ``o_proj`` and of the down projection (the experts') are partial sums, all-reduced in place.
Embedding, norms and the router are replicated.

Every rank runs the same engine loop over the same requests (SPMD, as ``torchrun`` launches it):
the scheduler is deterministic and every rank sees whole logits, so every rank picks the same
tokens (greedy, or sampling with a per-request seed). Processes: one per rank, with
``torch.distributed`` initialised over NCCL (GPU) or gloo (CPU) before the engine is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.errors import ConfigError, EngineError
from engine.isolation import secrets_withheld
from engine.model import CausalLM


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the tensor-parallel ranks (the default process group)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) on every rank -> (N, size * C), rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def current_group(tp: int) -> TPGroup:
    """The group for ``tp`` ranks; raises ConfigError unless torch.distributed runs with that many processes."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"tp={tp} needs {tp} processes with torch.distributed initialised "
                          f"(e.g. torchrun --nproc-per-node {tp} ...)")
    if dist.get_world_size() != tp:
        raise ConfigError(f"tp={tp} but torch.distributed has {dist.get_world_size()} processes")
    return TPGroup(dist.get_rank(), tp)


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The per-rank config: heads and intermediate sizes divided by ``tp``."""
    checks = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "intermediate_size": cfg.intermediate_size}
    if cfg.is_moe:
        checks["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{k} ({v})" for k, v in checks.items() if v % tp]
    if bad:
        raise ConfigError(f"tp={tp} does not divide {', '.join(bad)} of this {cfg.model_type} model")
    return dataclasses.replace(cfg, **{k: v // tp for k, v in checks.items()})


def _rows(t: torch.Tensor, parts: list[int], rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    """Rank's slice of each consecutive part (sizes ``parts``) along ``dim``, concatenated."""
    out, start = [], 0
    for n in parts:
        out.append(t.narrow(dim, start + rank * (n // tp), n // tp))
        start += n
    return torch.cat(out, dim=dim)


def shard_model(full: CausalLM, group: TPGroup) -> CausalLM:
    """A model holding rank ``group.rank``'s slice of ``full``'s weights, with its all-reduces wired in.

    Its ``config`` is the per-rank one (``shard_config``): the KV cache sized from it holds this rank's
    heads. ``full`` (already on this rank's device) is left intact; its tensors can be freed afterwards.
    """
    cfg, tp, rank = full.config, group.size, group.rank
    local_cfg = shard_config(cfg, tp)
    vocab_split = not cfg.tie_word_embeddings and cfg.vocab_size % tp == 0
    with torch.device("meta"):
        local = CausalLM(local_cfg, lm_head_rows=cfg.vocab_size // tp if vocab_split else None)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    state = {}
    for name, p in full.named_parameters():
        if "qkv_proj" in name:
            t = _rows(p, [q, kv, kv], rank, tp)
        elif name.endswith("o_proj.weight"):
            t = _rows(p, [q], rank, tp, dim=1)
        elif name.endswith("gate_up_proj.weight"):
            t = _rows(p, [cfg.intermediate_size] * 2, rank, tp)
        elif name.endswith("down_proj.weight"):
            t = _rows(p, [cfg.intermediate_size], rank, tp, dim=1)
        elif name.endswith("mlp.w13"):  # (E, 2I, H): [gate | up] per expert
            t = _rows(p, [cfg.moe_intermediate_size] * 2, rank, tp, dim=1)
        elif name.endswith("mlp.w2"):  # (E, H, I)
            t = _rows(p, [cfg.moe_intermediate_size], rank, tp, dim=2)
        elif name == "lm_head" and vocab_split:
            t = _rows(p, [cfg.vocab_size], rank, tp)
        else:
            t = p
        state[name] = t.contiguous().clone()
    local.load_state_dict(state, assign=True, strict=True)
    local.tp = group
    local.vocab_split = vocab_split
    for layer in local.layers:
        layer.self_attn.tp = group
        layer.mlp.tp = group
    return local.eval().requires_grad_(False)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: its own GPU for 'cuda', the CPU for 'cpu'."""
    return f"cuda:{rank}" if device in ("cuda", "cuda:0") else device


def _rank_main(rank: int, tp: int, port: int, backend: str, fn, args, results) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        out = fn(rank, *args)
        if rank == 0:
            results.put(("ok", out))
    except BaseException as e:  # the parent reports rank 0's failure
        if rank == 0:
            results.put(("error", f"{type(e).__name__}: {e}"))
        if not isinstance(e, EngineError):
            raise  # an unexpected failure: its traceback goes to stderr
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def run_ranks(tp: int, device: str, fn, *args):
    """Runs ``fn(rank, *args)`` in ``tp`` fresh processes joined by torch.distributed; returns rank 0's result.

    ``fn`` must be importable by name (a module-level function). NCCL when ``device`` is a GPU, else gloo.
    """
    import queue
    import socket

    import torch.multiprocessing as mp

    if device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise ConfigError(f"tp={tp} needs {tp} GPUs; this machine has {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, backend, fn, args, results)) for r in range(tp)]
    for p in procs:
        p.start()
    # read before joining: a large result fills the pipe, and rank 0 cannot exit until it is read
    got = None
    while got is None:
        try:
            got = results.get(timeout=1.0)
        except queue.Empty:
            if procs[0].exitcode is not None and results.empty():
                break  # rank 0 ended without a result
    for p in procs:
        p.join()
    if got is None:
        raise EngineError(f"tensor-parallel ranks exited with {[p.exitcode for p in procs]} and no result")
    status, out = got
    if status != "ok":
        raise EngineError(f"tensor-parallel rank 0 failed: {out}")
    return out


# ---- a served tensor-parallel group ---------------------------------------------------------------------
# The API process is rank 0 (the leader): its engine loop broadcasts, before every step, the requests it
# added, the ones it aborted and the admin commands it took, and every follower rank applies them in the
# same order, then steps with it. Control messages go over gloo (a CPU group beside NCCL on GPUs).

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
    from engine.errors import VariantError

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
    from engine.errors import VariantError

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


def _watch_parent(parent: int) -> None:
    """A follower ends when the process that started it is gone (killed without telling it)."""
    import os
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follower_main(rank: int, tp: int, port: int, backend: str, config, threads: int, parent: int) -> None:
    import threading

    from engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
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
        import os
        import socket
        import threading

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
        import os
        import sys
        import time

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
