"""A weather graph network shaped like GraphCast: encoder (lat-lon grid -> icosahedral mesh), processor
(message passing on the mesh), decoder (mesh -> grid), predicting the next state as a residual.

A request is the atmospheric state on an n x 2n lat-lon grid (``N_VARS`` variables per point). The mesh is an
icosahedron refined ``MESH_LEVEL`` times (642 nodes at level 3); each grid point sends to and receives from
its 3 nearest mesh nodes. The graphs depend on the resolution only, so they are built once per resolution and
kept; requests of one resolution stack along a leading batch axis (MessagePassing with ``node_dim=-2``).

torch_geometric is imported when the first model is built, not with this module: engine/ imports with torch
alone.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from engine.workloads import hot_ops

N_VARS = 8  # variables per grid point (e.g. temperature, winds, geopotential at a few levels)
HIDDEN = 64
MESH_LEVEL = 3
K_NEAREST = 3
SEED = 46


def icosphere(level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertices [V, 3] on the unit sphere, undirected edges [2, E]) of an icosahedron whose faces are split
    into four ``level`` times; the same on every machine (float64, then rounded)."""
    p = (1 + math.sqrt(5)) / 2
    verts = [(-1, p, 0), (1, p, 0), (-1, -p, 0), (1, -p, 0), (0, -1, p), (0, 1, p), (0, -1, -p), (0, 1, -p),
             (p, 0, -1), (p, 0, 1), (-p, 0, -1), (-p, 0, 1)]
    faces = [(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4), (11, 10, 2),
             (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8), (3, 8, 9), (4, 9, 5), (2, 4, 11),
             (6, 2, 10), (8, 6, 7), (9, 8, 1)]
    v = [torch.tensor(x, dtype=torch.float64) for x in verts]
    v = [x / x.norm() for x in v]
    for _ in range(level):
        mid: dict[tuple[int, int], int] = {}

        def middle(a: int, b: int) -> int:
            key = (min(a, b), max(a, b))
            if key not in mid:
                m = v[a] + v[b]
                v.append(m / m.norm())
                mid[key] = len(v) - 1
            return mid[key]

        new = []
        for a, b, c in faces:
            ab, bc, ca = middle(a, b), middle(b, c), middle(c, a)
            new += [(a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca)]
        faces = new
    edges = sorted({(min(a, b), max(a, b)) for f in faces for a, b in ((f[0], f[1]), (f[1], f[2]), (f[2], f[0]))})
    return torch.stack(v).float(), torch.tensor(edges, dtype=torch.long).t()


def latlon_grid(n_lat: int) -> torch.Tensor:
    """Unit vectors [n_lat * 2 n_lat, 3] of the cell centres of an n_lat x 2 n_lat grid, row-major (lat, lon)."""
    lat = (torch.arange(n_lat, dtype=torch.float64) + 0.5) / n_lat * math.pi - math.pi / 2
    lon = torch.arange(2 * n_lat, dtype=torch.float64) / (2 * n_lat) * 2 * math.pi
    la, lo = torch.meshgrid(lat, lon, indexing="ij")
    return torch.stack([la.cos() * lo.cos(), la.cos() * lo.sin(), la.sin()], -1).reshape(-1, 3).float()


def mlp(n_in: int, n_out: int, hidden: int = HIDDEN) -> nn.Sequential:
    """GraphCast's MLP: Linear, SiLU, Linear, LayerNorm."""
    return nn.Sequential(nn.Linear(n_in, hidden), nn.SiLU(), nn.Linear(hidden, n_out), nn.LayerNorm(n_out))


@functools.cache
def _interaction_class() -> type:
    from torch_geometric.nn import MessagePassing

    class Interaction(MessagePassing):
        """An interaction network block: edge message MLP(x_dst, x_src, e), sum at the destination, node update
        MLP(x_dst, sum) added to x_dst. ``x``: [*, N, F] (any leading batch axes); ``e``: [E, F_e]."""

        def __init__(self, hidden: int = HIDDEN) -> None:
            super().__init__(aggr="sum", node_dim=-2)
            self.edge_mlp = mlp(3 * hidden, hidden)
            self.node_mlp = mlp(2 * hidden, hidden)

        def forward(self, x_src: torch.Tensor, x_dst: torch.Tensor, edge_index: torch.Tensor,
                    e: torch.Tensor) -> torch.Tensor:
            aggr = self.propagate(edge_index, x=(x_src, x_dst), e=e, size=(x_src.shape[-2], x_dst.shape[-2]))
            return x_dst + self.node_mlp(torch.cat([x_dst, aggr], -1))

        def message(self, x_i: torch.Tensor, x_j: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
            return self.edge_mlp(torch.cat([x_i, x_j, e.expand(*x_i.shape[:-1], e.shape[-1])], -1))

        def aggregate(self, inputs: torch.Tensor, index: torch.Tensor, ptr: torch.Tensor | None = None,
                      dim_size: int | None = None) -> torch.Tensor:
            # inputs: [*, E, H] messages, index: [E] destinations -> [*, dim_size, H]. The sum is the hot op
            # scatter_sum; its torch form here is the library's own aggregation (its scatter_add_), so the default
            # path keeps the bits it had
            if hot_ops.active() == "torch":
                return super().aggregate(inputs, index, ptr=ptr, dim_size=dim_size)
            n = dim_size if dim_size is not None else int(index.max()) + 1 if index.numel() else 0
            return hot_ops.scatter_sum(inputs, index, n, self.node_dim)

    return Interaction


class WeatherGNN(nn.Module):
    def __init__(self, n_vars: int = N_VARS, hidden: int = HIDDEN, mesh_level: int = MESH_LEVEL,
                 processor_layers: int = 4) -> None:
        super().__init__()
        interaction = _interaction_class()
        self.n_vars = n_vars
        mesh, edges = icosphere(mesh_level)
        self.register_buffer("mesh_pos", mesh, persistent=False)
        self.register_buffer("mesh_edges", torch.cat([edges, edges.flip(0)], 1), persistent=False)  # both ways
        self.grid_embed = mlp(n_vars + 3, hidden)  # variables + static (sin lat, cos lon, sin lon)
        self.mesh_embed = mlp(3, hidden)
        self.g2m_edge, self.mesh_edge, self.m2g_edge = mlp(4, hidden), mlp(4, hidden), mlp(4, hidden)
        self.encoder = interaction(hidden)
        self.processor = nn.ModuleList(interaction(hidden) for _ in range(processor_layers))
        self.decoder = interaction(hidden)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, n_vars))
        self._graphs: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def graphs(self, n_lat: int) -> tuple[torch.Tensor, ...]:
        """(grid positions, grid->mesh edges, mesh->grid edges, their 4-feature geometry), built on the CPU in
        float32 once per resolution, device and dtype (the same graph everywhere; index ties broken the same way)."""
        key = (n_lat, self.mesh_pos.device, self.mesh_pos.dtype)
        if key not in self._graphs:
            grid, mesh = latlon_grid(n_lat), self.mesh_pos.cpu().float()
            near = torch.topk(grid @ mesh.t(), K_NEAREST, dim=1).indices  # [G, k] nearest mesh nodes
            g = torch.arange(grid.shape[0]).repeat_interleave(K_NEAREST)
            g2m = torch.stack([g, near.reshape(-1)])  # source grid point -> destination mesh node
            m2g = g2m.flip(0)

            def geometry(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
                d = dst - src
                return torch.cat([d, d.norm(dim=-1, keepdim=True)], -1)

            dev, dtype = self.mesh_pos.device, self.mesh_pos.dtype
            self._graphs[key] = tuple(t.to(dev, dtype) if t.is_floating_point() else t.to(dev) for t in (
                grid, g2m, m2g, geometry(grid[g2m[0]], mesh[g2m[1]]), geometry(mesh[m2g[0]], grid[m2g[1]])))
        return self._graphs[key]

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        # state: [B, n_lat, 2 n_lat, n_vars] -> next state, same shape
        if state.dim() != 4 or state.shape[2] != 2 * state.shape[1] or state.shape[3] != self.n_vars:
            raise ValueError(f"weather_gnn: input must be [batch, n_lat, 2*n_lat, {self.n_vars}], "
                             f"got {list(state.shape)}")
        b, n_lat = state.shape[:2]
        grid, g2m, m2g, g2m_geo, m2g_geo = self.graphs(n_lat)
        x = state.reshape(b, -1, self.n_vars)  # [B, G, V]
        static = torch.stack([grid[:, 2], grid[:, 0] / (1 - grid[:, 2] ** 2).clamp_min(1e-12).sqrt(),
                              grid[:, 1] / (1 - grid[:, 2] ** 2).clamp_min(1e-12).sqrt()], -1).to(x.dtype)
        hg = self.grid_embed(torch.cat([x, static.expand(b, -1, -1)], -1))  # [B, G, H]
        hm = self.mesh_embed(self.mesh_pos).expand(b, -1, -1)  # [B, M, H]
        mesh_src, mesh_dst = self.mesh_pos[self.mesh_edges[0]], self.mesh_pos[self.mesh_edges[1]]
        mesh_geo = torch.cat([mesh_dst - mesh_src, (mesh_dst - mesh_src).norm(dim=-1, keepdim=True)], -1)
        hm = self.encoder(hg, hm, g2m, self.g2m_edge(g2m_geo))
        e_mesh = self.mesh_edge(mesh_geo)
        for layer in self.processor:
            hm = layer(hm, hm, self.mesh_edges, e_mesh)
        hg = self.decoder(hm, hg, m2g, self.m2g_edge(m2g_geo))
        return state + self.head(hg).reshape(state.shape)


def build() -> WeatherGNN:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return WeatherGNN()


def make_request(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A smooth random state: each variable a few spherical-harmonic-like waves in latitude and longitude."""
    lat = torch.linspace(-1, 1, size).view(size, 1, 1)
    lon = torch.linspace(0, 2 * math.pi, 2 * size + 1)[:-1].view(1, 2 * size, 1)
    a, b, c = (torch.randn(1, 1, N_VARS, generator=gen) for _ in range(3))
    state = a * torch.cos(math.pi * lat) + b * torch.sin(lon) * lat + c * torch.cos(2 * lon)
    return {"state": state.unsqueeze(0)}  # [1, n, 2n, V]


def collate(requests: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    shapes = {tuple(r["state"].shape) for r in requests}
    if len(shapes) != 1:
        raise ValueError(f"weather_gnn: a batch stacks grids of one resolution only, got {sorted(shapes)}")
    return {"state": torch.cat([r["state"] for r in requests])}


def split(out: torch.Tensor, requests: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return list(out.split(1))
