"""Tensor parallelism: each rank holds a slice of every layer, and two all-reduces join them per layer.

Attention is split by heads (each rank holds ``H / tp`` query heads and ``KVH / tp`` KV heads, so
its KV cache holds only those), the MLP by intermediate columns (an MoE layer: every expert's
intermediate columns), the lm_head by vocabulary rows, gathered into whole logits. The outputs
of ``o_proj`` and of the down projection (the experts') are partial sums, all-reduced in place.
Embedding, norms and the router are replicated.

Every rank runs the same engine loop over the same requests (SPMD): the scheduler is deterministic and
every rank sees whole logits, so every rank picks the same tokens (greedy, or sampling with a per-request
seed). Processes: one per rank, with ``torch.distributed`` initialised over NCCL (GPU) or gloo (CPU) before
the engine is built. ``run_ranks`` runs a function on fresh ranks (``polyinf generate -tp N``); a served group
is engine/serving/rank_group.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config.model_config import ModelConfig
from engine.errors import ConfigError, EngineError
from engine.model.transformer import CausalLM


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
