"""Workload: a non-LLM model the loop tunes like the LLM engine: a module factory with synthetic weights, requests
whose shapes follow a recorded size, and the batch policy that groups them.

A request has one **size** on the workload's size axis (a PDE grid's resolution, a weather grid's latitude rows,
a protein's residues, a forecast's series). The batch policy says which requests may share one forward pass
without changing any real output:

- ``same_size``: only requests of equal size stack along a new batch axis (an FNO's FFT and a weather model's
  grid-to-mesh graph depend on the resolution, so a padded grid would change every output);
- ``concat``: requests of any size join along the node or channel axis (protein graphs are disjoint, a
  channel-independent forecaster never mixes series). The joined rows follow the requests' sizes, so a variant
  that asks for few shapes (batch buckets) also has the workload's ``pad`` round them up to a bounded set
  (engine/workloads/padding.py) with rows that touch no real one, and ``split`` drops them.

The registry ``WORKLOADS`` holds the four models; ``get_workload`` names the known ones when asked for another.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.workloads import fno, patchtst, protein_e3nn, weather_gnn
from engine.workloads.hot_ops import OPS, SCATTER_SUM, SPECTRAL_MUL

GROUPINGS = ("same_size", "concat")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: its size on the workload's size axis and its input tensors (named as the model's forward
    takes them for a batch of one)."""

    size: int
    tensors: dict[str, torch.Tensor] = field(compare=False)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int  # most requests in one forward pass (the library-typical default; a variant may change it)
    grouping: str  # "same_size" | "concat" (module docstring)

    def __post_init__(self) -> None:
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")

    def plan(self, sizes: Sequence[int], max_batch: int | None = None) -> list[list[int]]:
        """Indices of ``sizes`` grouped into forward passes, in arrival order within each group: equal sizes
        together (``same_size``) or consecutive requests (``concat``), at most ``max_batch`` per pass."""
        cap = max_batch or self.max_batch
        if self.grouping == "concat":
            order = [list(range(len(sizes)))]
        else:
            by_size: dict[int, list[int]] = {}
            for i, s in enumerate(sizes):
                by_size.setdefault(s, []).append(i)
            order = list(by_size.values())
        return [idx[k:k + cap] for idx in order for k in range(0, len(idx), cap)]


@dataclass(frozen=True)
class Workload:
    name: str
    field: str  # the science it serves: pde, weather, biology, time-series
    size_axis: str  # what a request's size counts
    size_levels: tuple[int, ...]  # the sizes recorded traffic maps onto, ascending (ops/workloads/traffic.py)
    min_size: int
    max_size: int
    factory: Callable[[], torch.nn.Module]  # the model at its default shapes, deterministic synthetic weights
    request: Callable[[int, torch.Generator], dict[str, torch.Tensor]]  # one request's tensors (CPU, float32)
    collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]  # a group -> forward kwargs
    split: Callable[[torch.Tensor, list[dict[str, torch.Tensor]]], list[torch.Tensor]]  # output -> per request
    batch: BatchPolicy
    library: str  # what the model is built with, and why (README "Non-LLM workloads")
    image_input: bool = False  # its inputs are [B, C, H, W] images, which a channels-last layout applies to
    # the hot ops its forward calls (engine/workloads/hot_ops.py OPS), which a variant may run as Triton kernels
    hot_ops: tuple[str, ...] = ()
    # concat only: the collated batch -> the same padded along its concat axes to ``padded_count`` rows, no real
    # output changed (the runner applies it when the variant has batch buckets); None: shapes follow the data
    pad: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.hot_ops) - set(OPS))
        if unknown:
            raise ValueError(f"{self.name}: unknown hot ops {unknown}; known: {', '.join(OPS)}")
        if not self.size_levels or list(self.size_levels) != sorted(self.size_levels):
            raise ValueError(f"{self.name}: size_levels must be a non-empty ascending tuple")
        if self.size_levels[0] < self.min_size or self.size_levels[-1] > self.max_size:
            raise ValueError(f"{self.name}: size_levels {self.size_levels} outside [{self.min_size}, {self.max_size}]")
        if self.pad is not None and self.batch.grouping != "concat":
            raise ValueError(f"{self.name}: a pad hook pads concatenated rows; a {self.batch.grouping} batch has none")

    @property
    def default_size(self) -> int:
        """The size a static setup is found at without traffic: the middle level."""
        return self.size_levels[len(self.size_levels) // 2]

    def build(self, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The model in inference mode on ``device``; the same seed gives the same weights on every machine (they
        are drawn on the CPU, then moved)."""
        module = self.factory().eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return module.to(device)

    def make_inputs(self, sizes: Sequence[int], seed: int, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> list[WorkloadRequest]:
        """One request per entry of ``sizes``, drawn from ``seed`` on the CPU (identical on every device), then
        moved to ``device``; floating tensors in ``dtype``, index tensors kept integral."""
        bad = [s for s in sizes if not (isinstance(s, int) and self.min_size <= s <= self.max_size)]
        if bad:
            raise ValueError(f"{self.name}: request sizes must be integers in [{self.min_size}, {self.max_size}] "
                             f"({self.size_axis}), got {bad[:5]}")
        gen = torch.Generator().manual_seed(int(seed))
        out = []
        for s in sizes:
            tensors = self.request(s, gen)
            out.append(WorkloadRequest(s, {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                                           for k, v in tensors.items()}))
        return out


WORKLOADS: dict[str, Workload] = {
    "fno": Workload(
        "fno", "pde", "grid resolution (an n x n grid)", (32, 48, 64, 96, 128), 2 * fno.MODES, 512,
        fno.build, fno.make_request, fno.collate, fno.split, BatchPolicy(8, "same_size"),
        "a faithful small FNO in plain torch (rfft2/irfft2, complex weights): the neuraloperator package drags "
        "heavy dependencies (wandb and more) that a bare GPU host lacks", image_input=True, hot_ops=(SPECTRAL_MUL,)),
    "weather_gnn": Workload(
        "weather_gnn", "weather", "latitude rows of the lat-lon grid (2n longitudes)", (12, 16, 24, 32, 48),
        4, 180, weather_gnn.build, weather_gnn.make_request, weather_gnn.collate, weather_gnn.split,
        BatchPolicy(4, "same_size"),
        "torch-geometric's MessagePassing (the maintained reference for message passing; scatter kernels per "
        "device)", hot_ops=(SCATTER_SUM,)),
    "protein_e3nn": Workload(
        "protein_e3nn", "biology", "residues of the protein's C-alpha trace", (32, 64, 96, 128, 192), 2, 1024,
        protein_e3nn.build, protein_e3nn.make_request, protein_e3nn.collate, protein_e3nn.split,
        BatchPolicy(8, "concat"),
        "e3nn (the maintained library of O(3)-equivariant tensor products, behind NequIP/MACE-style models)",
        hot_ops=(SCATTER_SUM,), pad=protein_e3nn.pad),
    "patchtst": Workload(
        "patchtst", "time-series", "series (channels) forecast together", (1, 3, 7, 12, 21), 1, 512,
        patchtst.build, patchtst.make_request, patchtst.collate, patchtst.split, BatchPolicy(16, "concat"),
        "plain torch, shaped like PatchTST (patching, channel independence, RevIN, flatten head): neuralforecast "
        "wraps it in a training framework (pytorch-lightning, ray) that serving does not need", pad=patchtst.pad),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
