"""WorkloadVariant: one form of a workload's forward pass, content-hashed into a stable ``variant_id`` like the
LLM's VariantSpec; and the runner that serves requests with it.

Each field carries its scope: ``forward`` changes swap the forward callable (hot swap, the module and its weights
stay), ``scheduler`` changes how requests are grouped. ``matmul_precision`` other than "highest" changes the
arithmetic on purpose, so such a variant is judged by the gate's tolerance mode (``needs_tolerance``); every
other variant must match the reference bit for bit.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.workloads.hot_ops import check_backend, hot_ops
from engine.workloads.workload import Workload, WorkloadRequest

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs")
# dynamo's per-code-object recompile limit for these workloads: every variant, batch bucket, resolution and
# precision of one module compiles into the cache of the same ``forward`` code object, and past the library's
# default (8) dynamo runs that code eagerly without saying so, which would pass eager figures off as compiled ones
# (a model that specialises on each of its 5 sizes, and on batch 1, does so again in each mode and precision)
RECOMPILE_LIMIT = 128
ACCUMULATED_RECOMPILE_LIMIT = 2048
MAX_GRAPHS = 64  # CUDA graphs one runner captures (one per input shape); further shapes run uncaptured
MATMUL_PRECISIONS = ("highest", "tf32", "bf16")
FORWARD, SCHEDULER = "forward", "scheduler"
# fields added after variant ids were first recorded: they count towards the id only when set, so recorded ids
# stay valid (engine/config/variant.py does the same)
_LATER_FIELDS = {"hot_ops": "torch"}


def _f(scope: str, default, **kw):
    return field(default=default, metadata={"scope": scope}, **kw)


@dataclass(frozen=True)
class WorkloadVariant:
    name: str = field(default="eager", metadata={"scope": None})  # a label; not part of the id
    compile_mode: str | None = _f(FORWARD, None)  # torch.compile mode; None: eager
    cuda_graphs: bool = _f(FORWARD, False)  # replay captured CUDA graphs, one per input shape (GPU only)
    channels_last: bool = _f(FORWARD, False)  # image inputs in NHWC memory order
    matmul_precision: str = _f(FORWARD, "highest")  # "highest" (IEEE float32), "tf32", "bf16" (autocast)
    # torch's deterministic algorithms (``determinism``): a CUDA scatter-add sums in a fixed order instead of by
    # atomics, so the output is the same on every run (what a bit-exact claim needs); a CPU's already is
    deterministic: bool = _f(FORWARD, False)
    # who runs the workload's hot ops (engine/workloads/hot_ops.py): "torch", or "triton" (the fused kernels of
    # kernels/workloads/; eager only). It claims nothing about precision: the gate judges it bit-exact
    hot_ops: str = _f(FORWARD, "torch")
    max_batch: int | None = _f(SCHEDULER, None)  # most requests per forward pass; None: the workload's policy
    # batch buckets: a group of n requests runs padded up to the smallest bucket >= n (the padding repeats its
    # last request, whose copies' outputs are dropped), and a concat workload's rows are padded by its ``pad``
    # hook, so compiled and captured forms see few batch shapes; empty: every group runs at its own size
    bucket_sizes: tuple[int, ...] = _f(SCHEDULER, ())

    def __post_init__(self) -> None:
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}")
        check_backend(self.hot_ops)
        if self.max_batch is not None and (isinstance(self.max_batch, bool) or self.max_batch < 1):
            raise ValueError(f"max_batch must be a positive integer or None, got {self.max_batch!r}")
        buckets = tuple(sorted(set(self.bucket_sizes)))
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"bucket_sizes must be positive integers, got {list(self.bucket_sizes)}")
        object.__setattr__(self, "bucket_sizes", buckets)
        if buckets and self.max_batch is not None and buckets[-1] < self.max_batch:
            raise ValueError(f"the largest bucket ({buckets[-1]}) must hold max_batch ({self.max_batch}) requests")

    @property
    def variant_id(self) -> str:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("scope")
                and not (f.name in _LATER_FIELDS and getattr(self, f.name) == _LATER_FIELDS[f.name])}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()[:16]

    @property
    def needs_tolerance(self) -> bool:
        """Whether the variant changes precision on purpose (judged by the gate's tolerance mode)."""
        return self.matmul_precision != "highest"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["bucket_sizes"] = list(self.bucket_sizes)
        d["variant_id"] = self.variant_id
        return d

    def changed_scopes(self, other: "WorkloadVariant") -> set[str]:
        return {f.metadata["scope"] for f in dataclasses.fields(self)
                if f.metadata.get("scope") and getattr(self, f.name) != getattr(other, f.name)}

    def describe(self) -> str:
        """The fields that differ from eager float32 at the workload's batch, e.g. ``compile=default, batch 8``."""
        parts = []
        if self.compile_mode:
            parts.append(f"compile={self.compile_mode}")
        if self.cuda_graphs:
            parts.append("cuda graphs")
        if self.deterministic:
            parts.append("deterministic")
        if self.hot_ops == "triton":
            parts.append("triton hot ops")
        if self.channels_last:
            parts.append("channels-last")
        if self.matmul_precision != "highest":
            parts.append(self.matmul_precision)
        if self.max_batch is not None:
            parts.append(f"batch {self.max_batch}")
        if self.bucket_sizes:
            parts.append("buckets " + "/".join(map(str, self.bucket_sizes)))
        return ", ".join(parts) or "eager"


def compile_available(device: str | torch.device) -> bool:
    """Whether torch.compile can build code for ``device``: any CUDA device; a CPU with a C++ compiler (Inductor's
    CPU backend writes C++)."""
    if torch.device(device).type == "cuda":
        return True
    return any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))


def refusal(workload: Workload, variant: WorkloadVariant, device: str | torch.device) -> str | None:
    """Why ``variant`` cannot run ``workload`` on ``device`` (None: it can)."""
    cuda = torch.device(device).type == "cuda"
    if variant.compile_mode and not compile_available(device):
        return "torch.compile needs a C++ compiler on the PATH to build CPU code"
    if variant.cuda_graphs and not cuda:
        return "cuda_graphs needs a CUDA device (graphs are captured on a CUDA stream)"
    if variant.compile_mode == "reduce-overhead" and variant.cuda_graphs:
        return "compile_mode reduce-overhead captures CUDA graphs itself; a graph cannot be captured inside another"
    if variant.compile_mode == "reduce-overhead" and not cuda:
        return "compile_mode reduce-overhead captures CUDA graphs; on a CPU it is the default mode under another name"
    if variant.matmul_precision == "tf32" and not cuda:
        return "matmul_precision tf32 is a tensor-core format of NVIDIA GPUs; a CPU has none"
    if variant.channels_last and not workload.image_input:
        return f"channels_last applies to image inputs [B, C, H, W]; {workload.name}'s are not images"
    if variant.hot_ops == "triton":
        return _triton_refusal(workload, variant, cuda)
    return None


def _triton_refusal(workload: Workload, variant: WorkloadVariant, cuda: bool) -> str | None:
    if not workload.hot_ops:
        return f"hot_ops triton replaces a workload's hot ops by Triton kernels; {workload.name} has none"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "hot_ops triton needs a CUDA device, or TRITON_INTERPRET=1 to run its kernels on the CPU interpreter"
    if variant.compile_mode:
        # one compiled wrapper serves every variant of a module and mode (``compiled``), and its guards do not see
        # the hot-op choice; dynamo traces the torch path (engine/workloads/hot_ops.py ``active``)
        return "hot_ops triton runs eager: torch.compile traces the hot ops' torch form"
    return None


@contextmanager
def precision(name: str, device_type: str) -> Iterator[None]:
    """Runs the block in ``name``'s arithmetic: "highest" forces IEEE float32 in matmuls and convolutions (cuDNN
    would take TF32 for convolutions by default), "tf32" allows TF32 in both, "bf16" autocasts to bfloat16."""
    if name == "bf16":
        with torch.autocast(device_type, dtype=torch.bfloat16):
            yield
        return
    fp32 = "tf32" if name == "tf32" else "ieee"
    knobs = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
    before = [k.fp32_precision for k in knobs]
    try:
        for k in knobs:
            k.fp32_precision = fp32
        yield
    finally:
        for k, b in zip(knobs, before):
            k.fp32_precision = b


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (CUBLAS_WORKSPACE_CONFIG)


def deterministic_cublas() -> None:
    """Sets CUBLAS_WORKSPACE_CONFIG (unless set) so that cuBLAS's GEMMs are deterministic under torch's
    deterministic algorithms; read when cuBLAS first allocates its workspace, so a process serving or tuning
    workloads calls this before its first CUDA matmul."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@contextmanager
def determinism(on: bool) -> Iterator[None]:
    """Runs the block with torch's deterministic algorithms on (``on``) or as it finds them. ``warn_only``: an
    operation with no deterministic form (cuBLAS without CUBLAS_WORKSPACE_CONFIG, for one) warns instead of
    raising; its result is then judged by the gate like any other."""
    if not on:
        yield
        return
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


@contextmanager
def forward_context(variant: "WorkloadVariant", device_type: str) -> Iterator[None]:
    """The arithmetic ``variant``'s forward runs in: its matmul precision, its determinism and who runs its hot
    ops."""
    with precision(variant.matmul_precision, device_type), determinism(variant.deterministic), \
            hot_ops(variant.hot_ops):
        yield


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT, accumulated: int = ACCUMULATED_RECOMPILE_LIMIT) -> None:
    """Raises dynamo's recompile limits to at least ``limit`` (per code object) and ``accumulated`` (under either
    name a torch version spells them: ``recompile_limit``, earlier ``cache_size_limit``); never lowers them."""
    import torch._dynamo.config as config

    for names, value in ((("recompile_limit", "cache_size_limit"), limit),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), accumulated)):
        for name in names:
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), value))


# module -> compile mode -> its torch.compile wrapper. A wrapper holds its module, so an entry lives until
# ``release_compiled`` drops it (the tuner does when it is done with a module)
_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Callable[..., torch.Tensor]]] = \
    weakref.WeakKeyDictionary()


def compiled(module: torch.nn.Module, mode: str) -> Callable[..., torch.Tensor]:
    """One ``torch.compile(module, mode=mode)`` per module and mode, shared by every runner: dynamo keeps its
    compiled code per code object with guards that include the backend, so a fresh wrapper per runner would
    recompile every shape another runner already compiled (seconds to minutes each, and cache entries towards
    the recompile limit); a shared one recompiles only where a guard (shape, layout, autocast, TF32) says so.
    ``dynamic`` stays the library default (automatic dynamic: a dimension is specialised until a second value of
    it is seen, then recompiled as symbolic), which is the setup PyTorch recommends and static-best uses.
    ``torch._dynamo.reset()`` is never called here: it would throw away the code of every live runner (the
    static-best runner a paired comparison alternates with included) and bill its recompilation to whichever arm
    runs next."""
    raise_recompile_limit()
    per_mode = _COMPILED.setdefault(module, {})
    if mode not in per_mode:
        per_mode[mode] = torch.compile(module, mode=mode)
    return per_mode[mode]


def release_compiled(module: torch.nn.Module) -> None:
    """Drops ``module``'s shared compiled wrappers (runners built on them keep theirs until they go)."""
    _COMPILED.pop(module, None)


class _Graphed:
    """CUDA graphs of ``fn`` (eager or compiled), one per input shape: the first call of a shape warms up and
    captures, later calls copy the inputs into the captured buffers and replay. Outputs are cloned (the buffers
    are reused). Past ``max_graphs`` shapes (a workload whose shapes follow its data, like a protein's edge count,
    sees a new one almost every batch) a new shape runs uncaptured, so graph memory stays bounded."""

    def __init__(self, fn: Callable[..., torch.Tensor], context: Callable[[], object],
                 max_graphs: int = MAX_GRAPHS) -> None:
        self.fn, self.context, self.max_graphs = fn, context, max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.uncaptured = 0  # calls of a shape past max_graphs

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items()))
        if key not in self.graphs and len(self.graphs) >= self.max_graphs:
            self.uncaptured += 1
            with self.context():
                return self.fn(**inputs)
        if key not in self.graphs:
            static = {k: v.clone() for k, v in inputs.items()}
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), self.context():
                for _ in range(2):  # warm-up: lazy initialisation and compilation stay out of the capture
                    self.fn(**static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), self.context():
                out = self.fn(**static)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        for k, v in inputs.items():
            static[k].copy_(v)
        graph.replay()
        return out.clone()


class WorkloadRunner:
    """Serves lists of requests with one variant over one module: groups them by the workload's batch policy
    (the variant's batch size), pads each group to its bucket, runs the variant's forward callable, and returns
    each request's output in request order. ``install`` swaps the forward callable; the module stays.

    A compiled variant runs the module's shared ``torch.compile`` wrapper (``compiled``: one per module and mode,
    dynamo's recompile limit raised to ``RECOMPILE_LIMIT`` first); ``cuda_graphs`` wraps the eager module or the
    compiled one in ``_Graphed``."""

    def __init__(self, workload: Workload, variant: WorkloadVariant, module: torch.nn.Module,
                 device: str | torch.device) -> None:
        why = refusal(workload, variant, device)
        if why:
            raise ValueError(f"variant {variant.name} ({variant.describe()}) cannot run {workload.name} on "
                             f"{device}: {why}")
        self.workload, self.module, self.device = workload, module, torch.device(device)
        self.variant = variant
        self.forward = self._forward_of(variant)

    def _forward_of(self, variant: WorkloadVariant) -> Callable[..., torch.Tensor]:
        # channels_last lays out the inputs only: the convolutions follow their input's layout, and the module's
        # parameters, shared with the reference and every other variant, stay as they are
        fn: Callable[..., torch.Tensor] = self.module
        if variant.compile_mode:
            fn = compiled(self.module, variant.compile_mode)
        if variant.cuda_graphs:
            fn = _Graphed(fn, lambda: forward_context(variant, self.device.type))
        return fn

    def install(self, variant: WorkloadVariant) -> None:
        """Hot swap: the next call runs ``variant``; a variant that cannot run here leaves the current one."""
        why = refusal(self.workload, variant, self.device)
        if why:
            raise ValueError(f"cannot swap to {variant.name} ({variant.describe()}): {why}")
        self.forward, self.variant = self._forward_of(variant), variant

    @property
    def batch_cap(self) -> int:
        """Most requests in one forward pass: the variant's batch (the workload's by default), within its largest
        bucket."""
        cap = self.variant.max_batch or self.workload.batch.max_batch
        return min(cap, self.variant.bucket_sizes[-1]) if self.variant.bucket_sizes else cap

    def _bucket(self, n: int) -> int:
        return next((b for b in self.variant.bucket_sizes if b >= n), n)

    def __call__(self, requests: list[WorkloadRequest]) -> list[torch.Tensor]:
        if not requests:
            raise ValueError(f"{self.workload.name}: an empty batch (no requests) has nothing to run")
        variant, out = self.variant, [None] * len(requests)
        for idx in self.workload.batch.plan([r.size for r in requests], self.batch_cap):
            group = [requests[i].tensors for i in idx]
            padded = group + [group[-1]] * (self._bucket(len(group)) - len(group))
            batch = self.workload.collate(padded)
            if variant.bucket_sizes and self.workload.pad is not None:  # concatenated rows to few counts too
                batch = self.workload.pad(batch)
            if variant.channels_last:
                batch = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
                         for k, v in batch.items()}
            with torch.inference_mode():
                if variant.cuda_graphs:  # the graph was captured under the variant's precision and determinism
                    y = self.forward(**batch)
                else:
                    with forward_context(variant, self.device.type):
                        y = self.forward(**batch)
            for i, o in zip(idx, self.workload.split(y, padded)):
                out[i] = o
        return out


def build_runner(workload: Workload, variant: WorkloadVariant, module: torch.nn.Module,
                 device: str | torch.device) -> WorkloadRunner:
    """A runner of ``variant`` over ``module`` (already on ``device``; never reloaded)."""
    return WorkloadRunner(workload, variant, module, device)
