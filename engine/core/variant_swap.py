"""Preparing, switching and rolling back the variant of a running engine.

``apply`` does the least work the changed scopes need, between two steps: ``scheduler`` knobs take effect
at the next step, a ``forward`` change swaps the operation table (and compiled forward and captured
graphs), a ``kv_layout`` change drains and rebuilds the KV pool; weights are never reloaded, and a
``parallel`` change needs a restart. Everything that can fail runs before anything is committed, so a
failure leaves the previous variant active. ``swap`` (the server's path) prepares a forward change
first, while the engine keeps serving, then switches it in.

``prepare`` reads the engine only through a ``ModelContext`` (the weights, the shapes, the active variant's
table, the pool) and changes none of it; each owner changes its own state at the commit
(``Scheduler.reconfigure``, ``ModelRunner.install``/``set_kv``/``drop_kv``, ``KVCache.release``), the engine
keeps the lock, the drain and the order. What a swap skipped comes back in its report's notes.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.model import precision
from engine.worker import kv_calibration
from engine.sched.block_manager import BlockManager
from engine.errors import VariantError
from engine.model.forward_ops import ForwardOps, build_ops
from engine.worker.model_runner import KVCache
from engine.config.variant import FORWARD, KV_LAYOUT, PARALLEL, SCHEDULER, VariantSpec

if TYPE_CHECKING:  # annotations only: the engine calls this module, not the other way round
    from engine.core.llm_engine import LLMEngine


@dataclass(frozen=True)
class SwapReport:
    variant_id: str
    scopes: list[str]  # the scopes the swap touched
    seconds: float
    notes: tuple[str, ...] = ()  # what the swap skipped or could not honour (also kept in the engine's notes)


@dataclass(frozen=True)
class ModelContext:
    """What preparing a variant reads of a running engine. Building, compiling, warming up and capturing a
    variant reads the weights and shapes here and writes only the pool's scratch block and the runner's
    capture buffers: nothing of the active variant."""

    model: Any
    model_config: Any
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    max_model_len: int
    runner: Any  # ModelRunner: warm_up, capture_graphs and capture_step_graphs only
    variant: VariantSpec  # the active one
    ops: ForwardOps  # the active one's table
    kv: KVCache  # the active pool


def context(engine: "LLMEngine") -> ModelContext:
    return ModelContext(engine.model, engine.model_config, engine.device, engine.dtype, engine.tokenizer,
                        engine.max_model_len, engine.runner, engine.variant, engine.ops, engine.kv)


@dataclass(frozen=True)
class PreparedVariant:
    """A variant's forward pass built, compiled, warmed up and captured, not yet active."""

    spec: VariantSpec
    ops: ForwardOps
    forward_fn: object  # the model, or its torch.compile'd wrapper
    graphs: object  # (DecodeGraphs | None, StepGraphs | None), or None
    seconds: float
    notes: tuple[str, ...] = ()


def prepare(ctx: ModelContext, spec: VariantSpec, kv: KVCache | None = None) -> PreparedVariant:
    """Builds, compiles, warms up and captures ``spec``'s forward pass without touching the active one.

    Safe to call from another thread while the engine serves: it reads the context and writes only the KV
    pool's scratch block. Raises VariantError when any part fails.
    """
    t0 = time.perf_counter()
    kv = kv or ctx.kv
    rebuild = FORWARD in spec.changed_scopes(ctx.variant) or spec.kv_cache_dtype != ctx.variant.kv_cache_dtype
    ops = build_ops_for(ctx, spec) if rebuild else ctx.ops
    try:
        fn = forward_fn(ctx, spec)
        ctx.runner.warm_up(ops, kv, fn)
    except VariantError:
        raise
    except Exception as e:
        raise VariantError(f"variant {spec.variant_id} failed its warm-up: {type(e).__name__}: {e}") from None
    notes: list[str] = []
    graphs = graphs_for(ctx, spec, ops, kv, notes)
    return PreparedVariant(spec, ops, fn, graphs, time.perf_counter() - t0, tuple(notes))


def apply(engine: "LLMEngine", spec: VariantSpec, prepared: PreparedVariant | None = None) -> SwapReport:
    """Makes ``spec`` the active variant with the least work its changed scopes need, between two steps.

    Requests in flight continue. On any failure the previous variant stays active and VariantError says
    why. With ``prepared`` (from ``prepare``, possibly run while serving) a forward swap only switches
    tables: serving pauses for one step's drain.
    """
    with engine.lock:
        t0 = time.perf_counter()
        scopes = spec.changed_scopes(engine.variant)
        if PARALLEL in scopes:
            raise VariantError(f"variant {spec.variant_id} changes the parallel layout (tp {engine.variant.tp} x dp "
                               f"{engine.variant.dp} -> tp {spec.tp} x dp {spec.dp}): that needs a restart "
                               f"(polyinf serve -tp {spec.tp} -dp {spec.dp})")
        if prepared is not None and prepared.spec != spec:
            raise VariantError(f"the prepared variant is {prepared.spec.variant_id}, not {spec.variant_id}")
        engine.drain()
        rebuilt, released = _new_kv(engine, spec) if KV_LAYOUT in scopes else (None, False)
        if scopes & {FORWARD, KV_LAYOUT} and (prepared is None or rebuilt is not None):
            try:
                prepared = prepare(context(engine), spec, rebuilt[0] if rebuilt else None)
            except VariantError as e:
                if released:  # the new pool goes (with the failed attempt's frames, which hold it) before the old returns
                    rebuilt = None
                    _clear_frames(e)
                    _reallocate_kv(engine, *released)
                raise
        # Everything that can fail has run; commit.
        if rebuilt is not None:
            engine.scheduler.preempt_all()  # running sequences are recomputed under the new layout
            engine.kv, engine.block_manager = rebuilt
            engine.scheduler.reconfigure(block_manager=engine.block_manager)
            engine.runner.set_kv(engine.kv)
        if SCHEDULER in scopes:
            engine.scheduler.reconfigure(config=spec)
        if FORWARD in scopes and rebuilt is None:
            engine.block_manager.reset_prefix_cache()  # cached KV came from the previous kernels
        if scopes & {FORWARD, KV_LAYOUT}:
            engine.ops = prepared.ops
            engine.runner.install(prepared.forward_fn, prepared.graphs)
        engine.previous_variant, engine.variant = engine.variant, spec
        notes = prepared.notes if prepared is not None and scopes & {FORWARD, KV_LAYOUT} else ()
        engine.notes.extend(notes)
        return SwapReport(spec.variant_id, sorted(scopes), time.perf_counter() - t0, notes)


def swap(engine: "LLMEngine", spec: VariantSpec) -> SwapReport:
    """The serving path's swap: a ``forward`` change is prepared first, without holding the engine, so steps
    from other threads go on meanwhile; then it is switched in between two steps (the pause is one step's
    drain). Changes with a ``kv_layout`` scope drain and rebuild as ``apply`` does."""
    scopes = spec.changed_scopes(engine.variant)
    prepared = None
    if FORWARD in scopes and not scopes & {KV_LAYOUT, PARALLEL}:
        prepared = prepare(context(engine), spec)
    return apply(engine, spec, prepared)


def rollback(engine: "LLMEngine") -> SwapReport:
    if engine.previous_variant is None:
        raise VariantError("no previous variant to roll back to")
    return swap(engine, engine.previous_variant)


def build_ops_for(ctx: ModelContext, spec: VariantSpec) -> ForwardOps:
    """``spec``'s operation table; generated kernels smoke-run at this model's shapes on its device; with a
    weight precision of its own, fed the quantized weights (made once per model, engine/model/precision.py)."""
    if spec.weight_dtype != precision.CHECKPOINT:
        precision.check_kernels(spec.weight_dtype, dict(spec.kernels))  # before any generated code is smoke-run
    ops = build_ops(spec, ctx.model_config.kernel_dims(), str(ctx.device))
    if spec.weight_dtype != precision.CHECKPOINT:
        ops = precision.quantized_ops(ops, ctx.model, spec.weight_dtype, dict(spec.kernels),
                                      fast_accum=spec.fp8_accumulation == "fast")
    if spec.kv_cache_dtype != precision.CHECKPOINT:  # an FP8 cache: keys and values scaled per layer
        ops = precision.fp8_kv_ops(ops, kv_calibration.kv_scales(ctx, ops, spec.weight_dtype))
    return ops


def forward_fn(ctx: ModelContext, spec: VariantSpec):
    """The eager forward for ``spec``: the model, or torch.compile of it (GPU only)."""
    if spec.compile_mode == "none" or ctx.device.type != "cuda":
        return ctx.model
    return torch.compile(ctx.model, mode=spec.compile_mode, dynamic=True)


def graphs_for(ctx: ModelContext, spec: VariantSpec, ops: ForwardOps, kv: KVCache, notes: list[str]):
    """Captured graphs for the spec, (decode steps, steps with prefill tokens; either None), or None. On a CPU,
    graphs and compile modes are skipped with a note (appended to ``notes``), as are graphs of steps with prefill
    tokens for a model with MoE layers (whose routing is not row by row)."""
    if not (spec.cuda_graph_batch_sizes or spec.prefill_graph_tokens or spec.compile_mode != "none"):
        return None
    if ctx.device.type != "cuda":
        notes.append(f"variant {spec.variant_id}: CUDA graphs and compile mode skipped on {ctx.device.type}")
        return None
    steps = spec.prefill_graph_tokens
    if steps and any(ctx.model_config.layer_is_moe(i) for i in range(ctx.model_config.num_hidden_layers)):
        notes.append(f"variant {spec.variant_id}: prefill_graph_tokens skipped: the model has MoE layers")
        steps = ()
    if not (spec.cuda_graph_batch_sizes or steps):
        return None
    if not spec.impl("attention").startswith("triton"):
        raise VariantError("CUDA graphs need a Triton attention kernel (the reference loops over host values)")
    try:
        return (ctx.runner.capture_graphs(ops, spec.cuda_graph_batch_sizes, kv) if spec.cuda_graph_batch_sizes
                else None,
                ctx.runner.capture_step_graphs(ops, steps, spec.max_num_seqs, kv) if steps else None)
    except Exception as e:
        raise VariantError(f"CUDA graph capture failed: {type(e).__name__}: {e}") from None


def _new_kv(engine: "LLMEngine", spec: VariantSpec) -> tuple[tuple[KVCache, BlockManager], tuple | None]:
    """The new pool and its block manager, allocated beside the old pool; where both do not fit (a cache sized
    to the GPU's memory, ``gpu_memory_utilization``), the old pool is released first and the new one allocated
    in its place. Returns the new pool and, when the old one was released, what re-allocating it takes (for a
    failure before the commit). Releasing loses nothing the commit would keep: the commit recomputes every
    running sequence under the new pool, and the old pool's prefix cache goes with it."""
    try:
        return _build_kv(engine, spec), None
    except VariantError as first:
        if not isinstance(first.__cause__, (RuntimeError, MemoryError)):
            raise
    old = (engine.kv.num_blocks, engine.kv.block_size, engine.kv.dtype)
    engine.scheduler.preempt_all()  # their keys and values are in the pool being released: recomputed
    engine.block_manager.reset_prefix_cache()
    engine.runner.drop_kv()  # its views and the graphs captured over the old pool
    engine.kv.release()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        return _build_kv(engine, spec), old
    except VariantError:
        _reallocate_kv(engine, *old)
        raise


def _reallocate_kv(engine: "LLMEngine", num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
    """The active variant's pool again after ``_new_kv`` released it and the swap failed: empty (every sequence
    was sent back to be recomputed), its decode graphs captured again over it."""
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    engine.kv = KVCache(engine.model_config, num_blocks, block_size, engine.device, dtype)
    engine.runner.set_kv(engine.kv)
    try:
        engine.runner.install(engine.runner.forward_fn,
                              graphs_for(context(engine), engine.variant, engine.ops, engine.kv, engine.notes))
    except VariantError as e:  # the step runs eagerly instead: slower, not wrong
        engine.notes.append(f"decode graphs not captured again after a failed swap: {e}")


def _clear_frames(e: BaseException) -> None:
    """Drops the locals of the frames an exception (and those it was raised from) keeps alive."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _build_kv(engine: "LLMEngine", spec: VariantSpec) -> tuple[KVCache, BlockManager]:
    """A new KV pool of the same memory under the new block size and precision, and its block manager."""
    cfg, old = engine.model_config, engine.kv.dtype
    dtype = precision.kv_cache_dtype(spec.kv_cache_dtype, engine.dtype)
    total = engine.kv.num_blocks * KVCache.bytes_per_block(cfg, engine.kv.block_size, old)
    num_blocks = max(1, total // KVCache.bytes_per_block(cfg, spec.block_size, dtype))
    try:
        kv = KVCache(cfg, num_blocks, spec.block_size, engine.device, dtype)
    except (RuntimeError, MemoryError) as e:
        raise VariantError(f"cannot allocate the new KV pool: {e}") from e
    return kv, BlockManager(num_blocks, spec.block_size, spec.enable_prefix_caching)
