"""An E(3)-equivariant network on a protein's C-alpha point cloud, built from e3nn's tensor products (the
convolution of Thomas et al.'s tensor field networks, as NequIP and e3nn's own examples write it).

A request is one protein of n residues: C-alpha positions [n, 3] (Angstrom) and residue types [n] (20 amino
acids). Edges join residues closer than ``CUTOFF``; every layer sends, along each edge, the tensor product of the
source's features with the edge direction's spherical harmonics, weighted by an MLP of the edge length, sums at
the destination, and passes the sum through a gated nonlinearity. The output per residue is one scalar (0e,
e.g. a confidence) and one vector (1o, e.g. a displacement): the scalar is invariant and the vector turns with
any rotation of the input.

Proteins of any sizes share a forward pass as one disjoint graph (their edges never cross). When a variant asks
for few shapes, ``pad`` adds dummy residues and edges among them only, up to bounded node and edge counts, so no
real residue's messages change; ``split`` drops the dummies.
e3nn is imported when the first model is built, not with this module: engine/ imports with torch alone.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.workloads.hot_ops import scatter_sum
from engine.workloads.padding import check_target, padded_count

CUTOFF = 10.0  # Angstrom: residues closer than this exchange messages
N_TYPES = 20
HIDDEN = "16x0e + 8x1o + 4x2e"
OUTPUT = "1x0e + 1x1o"
SEED = 47
# ``pad``'s dummy residues lie on the x axis from DUMMY_ORIGIN, DUMMY_SPACING apart: far from any real protein
# (centred at the origin) and from each other (beyond the cutoff), though only the edges given are ever used
DUMMY_ORIGIN, DUMMY_SPACING = 1e4, 20.0
# the grids ``pad`` rounds to (engine/workloads/padding.py): the edges carry the cost (each layer's tensor product
# and radial MLP run per edge, 7 to 25 of them per residue), so they take the fine grid (under a quarter padding)
# and the residues the coarse one (powers of two), which keeps the (residues, edges) pairs few: 60 over 3,000
# simulated batches of the recorded sizes in buckets of up to 16 proteins, where four per octave each gave 111,
# past what one runner captures (variants.MAX_GRAPHS, 64)
NODES_PER_OCTAVE, EDGES_PER_OCTAVE = 1, 4


@functools.cache
def _e3nn():
    from e3nn import nn as enn
    from e3nn import o3
    from e3nn.math import soft_one_hot_linspace

    return o3, enn, soft_one_hot_linspace


class Convolution(nn.Module):
    """One equivariant convolution: tensor product messages, summed per destination, self-interaction added."""

    def __init__(self, irreps_in: str, irreps_out: str, lmax: int = 2, n_basis: int = 10) -> None:
        super().__init__()
        o3, enn, _ = _e3nn()
        self.n_basis = n_basis
        # the harmonics' degrees as plain ints: an Irreps attribute on the module breaks torch.compile's guards
        # (Irrep raises on len())
        self.sh_degrees = list(range(lmax + 1))
        irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        self.tp = o3.FullyConnectedTensorProduct(irreps_in, irreps_sh, irreps_out, shared_weights=False)
        self.radial = enn.FullyConnectedNet([n_basis, 32, self.tp.weight_numel], torch.nn.functional.silu)
        self.self_interaction = o3.Linear(irreps_in, irreps_out)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        o3, _, soft_one_hot_linspace = _e3nn()
        src, dst = edge_index
        vec = pos[dst] - pos[src]  # [E, 3]
        sh = o3.spherical_harmonics(self.sh_degrees, vec, normalize=True, normalization="component")
        basis = soft_one_hot_linspace(vec.norm(dim=1), 0.0, CUTOFF, self.n_basis, basis="smooth_finite",
                                      cutoff=True) * self.n_basis ** 0.5
        weight = self.radial(basis)  # the radial MLP follows autocast (bfloat16 under a bf16 variant)
        # e3nn's generated contractions mix tensordot (one dtype only, not autocast) with autocast matmuls, so the
        # tensor products run in the features' own float32 with autocast off
        with torch.autocast(pos.device.type, enabled=False):
            x = x.float()
            msg = self.tp(x[src], sh.float(), weight.float())  # [E, irreps_out.dim]
            # the sums at the destination are the hot op scatter_sum (engine/workloads/hot_ops.py: torch's
            # index_add_ or a Triton segment sum)
            summed = scatter_sum(msg, dst, x.shape[0], 0)  # [N, irreps_out.dim]
            degree = scatter_sum(torch.ones_like(dst, dtype=msg.dtype), dst, x.shape[0], 0)  # [N]
            # a residue's messages over the root of its own neighbour count, and the two halves' sum scaled back
            # to unit variance: the features keep their scale through the layers whatever the protein's packing
            # (an output of order 1, like a trained model's)
            summed = summed / degree.clamp_min(1).sqrt().unsqueeze(1)
            return (self.self_interaction(x) + summed) / 2 ** 0.5


class ProteinE3NN(nn.Module):
    def __init__(self, hidden: str = HIDDEN, output: str = OUTPUT, layers: int = 3) -> None:
        super().__init__()
        o3, enn, _ = _e3nn()
        self.embed = nn.Embedding(N_TYPES, 16)
        irreps_hidden = o3.Irreps(hidden)
        scalars = o3.Irreps([(mul, ir) for mul, ir in irreps_hidden if ir.l == 0])
        gated = o3.Irreps([(mul, ir) for mul, ir in irreps_hidden if ir.l > 0])
        gates = o3.Irreps(f"{gated.num_irreps}x0e")
        self.convs, self.gates = nn.ModuleList(), nn.ModuleList()
        irreps = o3.Irreps("16x0e")
        for _ in range(layers):
            gate = enn.Gate(scalars, [torch.nn.functional.silu], gates, [torch.sigmoid], gated)
            self.convs.append(Convolution(str(irreps), str(gate.irreps_in)))
            self.gates.append(gate)
            irreps = gate.irreps_out
        self.out = Convolution(str(irreps), output)

    def forward(self, pos: torch.Tensor, types: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        # pos: [N, 3] float, types: [N] int64, edge_index: [2, E] int64 (source, destination) -> [N, 4] (0e, 1o)
        if pos.dim() != 2 or pos.shape[1] != 3:
            raise ValueError(f"protein_e3nn: pos must be [residues, 3], got {list(pos.shape)}")
        if types.shape != pos.shape[:1] or edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"protein_e3nn: types must be [residues] and edge_index [2, edges], got "
                             f"{list(types.shape)} and {list(edge_index.shape)}")
        x = self.embed(types).to(pos.dtype)
        for conv, gate in zip(self.convs, self.gates):
            x = gate(conv(x, pos, edge_index))
        return self.out(x, pos, edge_index)


def radius_edges(pos: torch.Tensor, cutoff: float = CUTOFF) -> torch.Tensor:
    """[2, E] (source, destination) of every ordered pair of distinct residues closer than ``cutoff``, in row-major
    order of (destination, source) so that every device sums a residue's messages in the same order."""
    d = torch.cdist(pos.double(), pos.double())
    near = (d < cutoff) & ~torch.eye(pos.shape[0], dtype=torch.bool, device=pos.device)
    dst, src = near.nonzero(as_tuple=True)
    return torch.stack([src, dst])


def build() -> ProteinE3NN:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return ProteinE3NN()


def make_request(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A C-alpha trace: a persistent random walk of 3.8 A steps, residue types uniform; the edges of its 10 A
    radius graph."""
    steps = torch.randn(size, 3, generator=gen)
    steps = steps / steps.norm(dim=1, keepdim=True)
    d = steps.clone()
    for i in range(1, size):  # each step keeps some of the previous direction: a chain, not a diffusing cloud
        d[i] = steps[i] + 0.5 * d[i - 1]
        d[i] = d[i] / d[i].norm()
    pos = torch.cumsum(3.8 * d, 0)
    pos = pos - pos.mean(0)
    types = torch.randint(0, N_TYPES, (size,), generator=gen)
    return {"pos": pos, "types": types, "edge_index": radius_edges(pos)}


def collate(requests: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One disjoint graph: positions and types concatenated, each protein's edges shifted by its offset."""
    offsets, total = [], 0
    for r in requests:
        offsets.append(total)
        total += r["pos"].shape[0]
    return {"pos": torch.cat([r["pos"] for r in requests]), "types": torch.cat([r["types"] for r in requests]),
            "edge_index": torch.cat([r["edge_index"] + o for r, o in zip(requests, offsets)], 1)}


def pad(batch: dict[str, torch.Tensor], nodes: int | None = None,
        edges: int | None = None) -> dict[str, torch.Tensor]:
    """The collated graph with dummy residues appended up to ``nodes`` and dummy edges up to ``edges`` (defaults:
    ``padded_count`` of its own counts on NODES_PER_OCTAVE's and EDGES_PER_OCTAVE's grids, with room for two
    dummies when edges are added).

    A dummy residue is type 0 at DUMMY_ORIGIN + i * DUMMY_SPACING on the x axis; dummy edge j runs from dummy
    j % k to dummy (j + 1) % k of the k dummies: two distinct residues, since a zero-length edge has no direction
    and its normalised harmonics would be NaN. Every dummy edge ends at a dummy, so no real residue's sums or
    neighbour counts change, and the dummies' own outputs are finite and dropped by ``split``."""
    pos, types, edge_index = batch["pos"], batch["types"], batch["edge_index"]  # [N, 3], [N], [2, E]
    n, e = pos.shape[0], edge_index.shape[1]
    edges = padded_count(e, EDGES_PER_OCTAVE) if edges is None else edges
    check_target("edges", e, edges)
    if nodes is None:
        nodes = padded_count(n + 2 if edges > e else n, NODES_PER_OCTAVE)
    check_target("residues", n, nodes)
    k = nodes - n
    if edges > e and k < 2:
        raise ValueError(f"padding {e} edges to {edges} needs two dummy residues, but {nodes} residues leave {k}")
    if k == 0:
        return batch
    offsets = torch.arange(k, device=pos.device, dtype=pos.dtype) * DUMMY_SPACING + DUMMY_ORIGIN
    dummy_pos = torch.zeros(k, 3, device=pos.device, dtype=pos.dtype)
    dummy_pos[:, 0] = offsets
    j = torch.arange(edges - e, device=edge_index.device, dtype=edge_index.dtype)
    dummy_edges = torch.stack([j % k, (j + 1) % k]) + n
    return {"pos": torch.cat([pos, dummy_pos]), "types": torch.cat([types, types.new_zeros(k)]),
            "edge_index": torch.cat([edge_index, dummy_edges], 1)}


def split(out: torch.Tensor, requests: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each request's outputs [its residues, 4]; rows past the requests' own (``pad``'s dummies) are dropped."""
    sizes = [r["pos"].shape[0] for r in requests]
    return list(out[:sum(sizes)].split(sizes))
