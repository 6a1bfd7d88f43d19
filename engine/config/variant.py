"""VariantSpec: everything that defines one engine form, content-hashed into a stable ``variant_id``.

Each field carries the scope a change of it needs:
- ``forward``: swap kernels between two steps (hot swap, weights stay);
- ``scheduler``: takes effect at the next step;
- ``kv_layout``: drain and rebuild the KV pool, weights stay;
- ``parallel``: re-shard, which needs a restart.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

FORWARD, SCHEDULER, KV_LAYOUT, PARALLEL = "forward", "scheduler", "kv_layout", "parallel"
# The order in which scopes grow in cost; a swap does the work of the largest scope it touches.
SCOPE_ORDER = (SCHEDULER, FORWARD, KV_LAYOUT, PARALLEL)

# composite operations (rotary_store_kv, norm_rotary_store_kv, rotary_attention, norm_linear, act_linear,
# norm_moe) come after the parts they are composed of
OP_NAMES = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul", "store_kv", "rotary_store_kv",
            "norm_rotary_store_kv", "attention", "rotary_attention", "moe", "linear", "norm_linear", "act_linear",
            "norm_moe", "prefetch")
BUILTIN_IMPLS = {
    "rms_norm": ("reference", "triton"),
    "fused_add_rms_norm": ("reference", "triton"),
    "rotary": ("reference", "triton"),
    "silu_and_mul": ("reference", "triton"),
    "store_kv": ("reference", "triton"),
    # "reference": the variant's rotary, then its store_kv; "triton": one fused launch
    "rotary_store_kv": ("reference", "triton"),
    # q_norm / k_norm (Qwen3), then rotary_store_kv: "reference": the variant's rms_norm, then its
    # rotary_store_kv; "triton": one launch
    "norm_rotary_store_kv": ("reference", "triton"),
    "attention": ("reference", "triton_paged", "triton_split_kv"),
    # the attention block between the projections: (norm_)rotary_store_kv, then attention; "reference": the
    # variant's own parts; "triton": for decode batches one launch for the q/k norms, rotary, KV store and
    # split-KV attention (the splits merged by the merge kernel after it, or by the last split to finish),
    # otherwise the Triton parts
    "rotary_attention": ("reference", "triton"),
    "moe": ("reference", "triton"),
    "linear": ("reference", "triton"),  # "triton": matrix-vector kernel for decode batches of <= max_m rows
    # "reference": the variant's fused_add_rms_norm (silu_and_mul), then its linear; "triton": one fused kernel
    "norm_linear": ("reference", "triton"),
    "act_linear": ("reference", "triton"),
    # the block after attention of an MoE layer: residual add + RMSNorm, router, moe; "reference": the variant's
    # fused_add_rms_norm, linear and moe; "triton": norm, router and routing in one launch, then the experts
    # (measured slower in batch-1 decode on an H200 than the parts, with and without dependent launch, so in no
    # preset of engine/config/presets.py: bench/RESULTS.md)
    "norm_moe": ("reference", "triton"),
    # a hint: the attention's output projection read into L2 while the attention runs; "reference": nothing,
    # "triton": a side-stream kernel (kernels/attention/prefetch_triton.py)
    "prefetch": ("reference", "triton"),
}
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
WEIGHT_DTYPES = ("auto", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_ACCUMULATIONS = ("float32", "fast")


def _f(scope: str, default: Any = dataclasses.MISSING, schema: dict | None = None, help: str = "", **kw):
    """A field with its scope, and where it is a tunable knob, its JSON schema (what an agent may propose; the
    CLI's flag takes it too) and its help text."""
    meta = {"scope": scope, "schema": schema, "help": help}
    if default is dataclasses.MISSING:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def _op_map(value: dict) -> dict:
    """The JSON schema of a per-operation object: known operation names only (as properties, which grammar-
    constrained decoders enforce; propertyNames they may not), each mapped to ``value``."""
    return {"type": "object", "properties": {op: value for op in OP_NAMES}, "additionalProperties": False}


def _shown(kind: str, value, fill: str):
    """A per-op entry of a kernel field as ``changes_from`` prints it (generated source by name only)."""
    if value == fill or kind == "kernels":
        return value
    return "source" if kind == "generated_source" else dict(value)


@dataclass(frozen=True)
class VariantSpec:
    name: str = field(default="default", metadata={"scope": None})  # a label; not part of the id
    # engine knobs
    max_num_seqs: int = _f(SCHEDULER, 64, {"type": "integer", "minimum": 1, "maximum": 1024},
                           "most sequences in one step")
    max_num_batched_tokens: int = _f(SCHEDULER, 2048, {"type": "integer", "minimum": 1, "maximum": 65536},
                                     "most tokens in one step (the token budget)")
    prefill_chunk_size: int | None = _f(SCHEDULER, None, {"type": ["integer", "null"], "minimum": 1, "maximum": 65536},
                                        "most prompt tokens of one sequence per step (null: the budget)")
    # prompt-lookup speculation (engine/sched/speculation.py): drafts from the request's own tokens
    speculative_tokens: int = _f(SCHEDULER, 0, {"type": "integer", "minimum": 0, "maximum": 16},
                                 "most tokens one request speculates per step by prompt lookup (0: off)")
    prompt_lookup_max: int = _f(SCHEDULER, 3, {"type": "integer", "minimum": 1, "maximum": 8},
                                "longest n-gram of the request's last tokens looked up in its earlier tokens")
    prompt_lookup_min: int = _f(SCHEDULER, 1, {"type": "integer", "minimum": 1, "maximum": 8},
                                "shortest n-gram looked up")
    speculative_max_batch: int = _f(SCHEDULER, 8, {"type": "integer", "minimum": 1, "maximum": 1024},
                                    "no speculation while more sequences than this run")
    speculative_min_acceptance: float = _f(SCHEDULER, 0.2, {"type": "number", "minimum": 0, "maximum": 1},
                                           "a request pauses speculating when its running acceptance falls below")
    block_size: int = _f(KV_LAYOUT, 16, {"type": "integer", "enum": [8, 16, 32, 64]}, "tokens per KV-cache block")
    enable_prefix_caching: bool = _f(KV_LAYOUT, True, {"type": "boolean"}, "reuse cached KV blocks of shared prefixes")
    # the KV cache's element type (engine/model/precision.py): the checkpoint's, or FP8 e4m3 with a scale per layer
    kv_cache_dtype: str = _f(KV_LAYOUT, "auto", {"enum": list(KV_CACHE_DTYPES)},
                             "KV cache elements: the checkpoint's dtype (auto) or fp8 (e4m3, a scale per layer): "
                             "twice the blocks in the same memory")
    cuda_graph_batch_sizes: tuple[int, ...] = _f(FORWARD, (), {"type": "array", "maxItems": 32, "items": {
        "type": "integer", "minimum": 1, "maximum": 1024}}, "decode batch sizes captured as CUDA graphs")
    prefill_graph_tokens: tuple[int, ...] = _f(FORWARD, (), {"type": "array", "maxItems": 16, "items": {
        "type": "integer", "minimum": 16, "maximum": 65536}}, "token counts of steps with prefill tokens captured as "
        "CUDA graphs (a step is padded to the next; dense models)")
    compile_mode: str = _f(FORWARD, "none", {"enum": list(COMPILE_MODES)}, "torch.compile mode (GPU)")
    # kernel choice per operation: a built-in name, or "generated:<module>.<function>"
    kernels: tuple[tuple[str, str], ...] = _f(FORWARD, (), _op_map({"type": "string"}),
                                             "implementation per operation")
    # tunable kernel parameters: (op, ((param, value), ...)), e.g. attention block_n / num_warps / num_splits
    kernel_params: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = _f(
        FORWARD, (), _op_map({"type": "object", "additionalProperties": {"type": "integer"}}),
        "tunable parameters per operation")
    # generated source, module name -> text
    generated_source: tuple[tuple[str, str], ...] = _f(FORWARD, ())
    # the dense projections' weights (engine/model/precision.py): the checkpoint's, or a per-channel quantized copy
    weight_dtype: str = _f(FORWARD, "auto", {"enum": list(WEIGHT_DTYPES)},
                           "dense projections' weights: the checkpoint's precision (auto), int8 or fp8 (e4m3), "
                           "one scale per output channel")
    fp8_accumulation: str = _f(FORWARD, "float32", {"enum": list(FP8_ACCUMULATIONS)},
                               "FP8 weights' GEMM from 65 rows (prefill, wide batches): its sums promoted to float32 "
                               "(float32) or kept in the tensor cores' accumulator (fast: quicker on Hopper, fewer "
                               "mantissa bits over long rows)")
    tp: int = _f(PARALLEL, 1)
    dp: int = _f(PARALLEL, 1)

    def __post_init__(self) -> None:
        # accept dicts and lists (JSON) and normalize to sorted tuples, so equal specs hash equal
        try:
            kernels = dict(self.kernels)
            params = {op: tuple(sorted(dict(p).items())) for op, p in dict(self.kernel_params).items()}
            source = dict(self.generated_source)
            graphs = tuple(sorted(set(self.cuda_graph_batch_sizes)))
            steps = tuple(sorted(set(self.prefill_graph_tokens)))
        except (TypeError, ValueError) as e:
            raise ConfigError("variant fields kernels, kernel_params (op -> {param: value}) and generated_source "
                              "must be objects, cuda_graph_batch_sizes and prefill_graph_tokens lists of integers: "
                              f"{e}") from None
        for what, mapping in (("kernels", kernels), ("generated_source", source)):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
                raise ConfigError(f"variant field {what} must map names to strings")
        if not all(isinstance(k, str) for p in params.values() for k, _ in p):
            raise ConfigError("kernel_params' parameter names must be strings")
        for what, sizes in (("cuda_graph_batch_sizes", graphs), ("prefill_graph_tokens", steps)):
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in sizes):
                raise ConfigError(f"{what} must be integers, got {list(sizes)}")
        object.__setattr__(self, "kernels", tuple(sorted(kernels.items())))
        object.__setattr__(self, "kernel_params", tuple(sorted(params.items())))
        object.__setattr__(self, "generated_source", tuple(sorted(source.items())))
        object.__setattr__(self, "cuda_graph_batch_sizes", graphs)
        object.__setattr__(self, "prefill_graph_tokens", steps)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"variant field {name} must be a positive integer, got {v!r}")
        for name in ("speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "speculative_tokens" else 1):
                kind = "non-negative" if name == "speculative_tokens" else "positive"
                raise ConfigError(f"variant field {name} must be a {kind} integer, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        a = self.speculative_min_acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ConfigError(f"speculative_min_acceptance must be a number in [0, 1], got {a!r}")
        object.__setattr__(self, "speculative_min_acceptance", float(a))  # 0 and 0.0 hash alike
        if self.prefill_chunk_size is not None and (not isinstance(self.prefill_chunk_size, int)
                                                    or isinstance(self.prefill_chunk_size, bool)
                                                    or self.prefill_chunk_size < 1):
            raise ConfigError(f"prefill_chunk_size must be an integer >= 1 or null, got {self.prefill_chunk_size!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.name, str):
            raise ConfigError(f"variant name must be a string, got {self.name!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.fp8_accumulation not in FP8_ACCUMULATIONS:
            raise ConfigError(f"fp8_accumulation must be one of {', '.join(FP8_ACCUMULATIONS)}, "
                              f"got {self.fp8_accumulation!r}")
        if self.fp8_accumulation != "float32" and self.weight_dtype != "fp8":
            raise ConfigError(f"fp8_accumulation {self.fp8_accumulation} applies to weight_dtype fp8, "
                              f"not {self.weight_dtype}")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ConfigError("cuda_graph_batch_sizes must be positive")
        if any(not 16 <= t <= 65536 for t in self.prefill_graph_tokens):
            raise ConfigError(f"prefill_graph_tokens must lie in 16-65536, got {list(self.prefill_graph_tokens)}")
        for op, impl in self.kernels:
            if op not in OP_NAMES:
                raise ConfigError(f"unknown operation {op!r} in kernels; known: {', '.join(OP_NAMES)}")
            if impl.startswith("generated:"):
                module = impl.split(":", 1)[1].rsplit(".", 1)[0]
                if module not in source:
                    raise ConfigError(f"kernel {op}={impl} names module {module!r}, which generated_source lacks")
            elif impl not in BUILTIN_IMPLS[op]:
                raise ConfigError(f"unknown implementation {impl!r} for {op}; built-in: {', '.join(BUILTIN_IMPLS[op])}")
        for op, _ in self.kernel_params:
            if op not in OP_NAMES:
                raise ConfigError(f"unknown operation {op!r} in kernel_params")

    # ---- identity and serialization -----------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kernels"] = dict(self.kernels)
        d["kernel_params"] = {op: dict(p) for op, p in self.kernel_params}
        d["generated_source"] = dict(self.generated_source)
        d["cuda_graph_batch_sizes"] = list(self.cuda_graph_batch_sizes)
        d["prefill_graph_tokens"] = list(self.prefill_graph_tokens)
        d["variant_id"] = self.variant_id
        return d

    @classmethod
    def change_schema(cls) -> dict[str, dict]:
        """Field -> JSON schema of the fields a proposal may change (generated source goes separately)."""
        return {f.name: f.metadata["schema"] for f in dataclasses.fields(cls) if f.metadata.get("schema")}

    @classmethod
    def knob_fields(cls) -> list[dataclasses.Field]:
        """The scheduler and KV-layout knobs and the weight precision (with FP8's accumulation): plain values a
        command-line flag can set."""
        return [f for f in dataclasses.fields(cls)
                if f.metadata.get("scope") in (SCHEDULER, KV_LAYOUT) or f.name in ("weight_dtype", "fp8_accumulation")]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VariantSpec":
        if not isinstance(data, dict):
            raise ConfigError("a variant must be a JSON object")
        data = dict(data)
        claimed = data.pop("variant_id", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown variant fields: {', '.join(sorted(unknown))}")
        try:
            for name in ("cuda_graph_batch_sizes", "prefill_graph_tokens"):
                if name in data:
                    data[name] = tuple(data[name])
            spec = cls(**data)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"bad variant: {e}") from None
        if claimed is not None and claimed != spec.variant_id:
            raise ConfigError(f"variant_id {claimed} does not match the content (expected {spec.variant_id})")
        return spec

    @classmethod
    def load(cls, path: str | Path) -> "VariantSpec":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError(f"variant file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"variant file {path} is not valid JSON: {e}") from None

    @property
    def variant_id(self) -> str:
        # fields added after ids were first recorded count only when set, so recorded ids stay valid
        # (and the speculation policy's fields only when it speculates)
        body = {k: v for k, v in dataclasses.asdict(self).items()
                if k != "name" and not (k in _LATER_FIELDS and v == _DEFAULTS[k])
                and not (k in SPECULATION_FIELDS and not self.speculative_tokens)}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()[:16]

    # ---- scopes ---------------------------------------------------------------------------------
    @staticmethod
    def scope_of(field_name: str) -> str | None:
        return {f.name: f.metadata.get("scope") for f in dataclasses.fields(VariantSpec)}[field_name]

    def changed_scopes(self, other: "VariantSpec") -> set[str]:
        """The scopes whose fields differ between this spec and ``other``."""
        return {
            f.metadata["scope"] for f in dataclasses.fields(self)
            if f.metadata.get("scope") and getattr(self, f.name) != getattr(other, f.name)
        }

    def changes_from(self, base: "VariantSpec") -> str:
        """What differs from ``base``, for a person: 'max_num_seqs 8 -> 4; rms_norm reference -> triton'."""
        out = []
        for f in dataclasses.fields(self):
            old, new = getattr(base, f.name), getattr(self, f.name)
            if f.name == "name" or old == new:
                continue
            if f.name in ("kernels", "kernel_params", "generated_source"):
                a, b = dict(old), dict(new)
                fill = "reference" if f.name == "kernels" else "-"
                label = "" if f.name == "kernels" else " " + f.name
                for op in sorted(set(a) | set(b)):
                    if a.get(op) != b.get(op):
                        out.append(f"{op}{label} {_shown(f.name, a.get(op, fill), fill)} -> "
                                   f"{_shown(f.name, b.get(op, fill), fill)}")
            else:
                out.append(f"{f.name} {old} -> {new}")
        return "; ".join(out) or "none"

    def impl(self, op: str) -> str:
        return dict(self.kernels).get(op, "reference")

    def params(self, op: str) -> dict[str, int]:
        return dict(dict(self.kernel_params).get(op, ()))


# prompt-lookup speculation's fields (engine/sched/speculation.py), added after ids were first recorded
SPECULATION_FIELDS = ("speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "speculative_max_batch",
                      "speculative_min_acceptance")
_LATER_FIELDS = (*SPECULATION_FIELDS, "weight_dtype", "kv_cache_dtype", "prefill_graph_tokens", "fp8_accumulation")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(VariantSpec)}
REFERENCE_VARIANT = VariantSpec(name="reference")
