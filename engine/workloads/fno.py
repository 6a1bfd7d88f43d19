"""A Fourier neural operator for a 2-D PDE (Li et al., "Fourier Neural Operator for Parametric PDEs", the 2-D
Darcy / Navier-Stokes form): lifting, four Fourier layers (spectral convolution + a pointwise 1x1 convolution,
GELU between), projection. Written here in plain torch; the workload registry says why.

A request is the vorticity's last ``T_IN`` time steps on an n x n grid; the operator maps them to the next step on
the same grid. The spectral convolution keeps the lowest ``modes`` frequencies of each axis, so one set of weights
serves every resolution of at least 2 * modes.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.workloads.hot_ops import spectral_mul

MODES = 12  # Fourier modes kept per axis (the paper's 2-D setting)
WIDTH = 32  # channels of the Fourier layers
T_IN = 10  # time steps of the vorticity a request gives (the paper's Navier-Stokes setting)
SEED = 45


class SpectralConv2d(nn.Module):
    """u -> irfft2(W . rfft2(u)) over the lowest ``modes`` frequencies: the positive-row block with ``weight1`` and
    the negative-row block (the last ``modes`` rows of rfft2's output) with ``weight2``; other modes are zero. The
    weight products are the hot op ``spectral_mul`` (engine/workloads/hot_ops.py: torch or a Triton kernel)."""

    def __init__(self, in_channels: int, out_channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        scale = 1 / (in_channels * out_channels)
        shape = (in_channels, out_channels, modes, modes)
        self.weight1 = nn.Parameter(scale * torch.rand(*shape, dtype=torch.cfloat))
        self.weight2 = nn.Parameter(scale * torch.rand(*shape, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C_in, H, W]; the FFT runs in float32 whatever the autocast dtype (no half-precision FFT of any
        # size on every device), as neuraloperator does, and on a contiguous copy: on a channels-last input the
        # CPU FFT plans a batch of one and a batch of several differently (other bits at some sizes)
        b, _, h, w = x.shape
        m = self.modes
        x_ft = torch.fft.rfft2(x.float().contiguous())  # [B, C_in, H, W // 2 + 1] complex
        out_ft = torch.zeros(b, self.weight1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :m, :m] = spectral_mul(x_ft[:, :, :m, :m], self.weight1)
        out_ft[:, :, -m:, :m] = spectral_mul(x_ft[:, :, -m:, :m], self.weight2)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNO2d(nn.Module):
    """Li et al.'s ``FNO2d`` (fourier_2d_time.py, Navier-Stokes): the vorticity's last ``in_channels`` steps and
    the (x, y) coordinates lifted pointwise to ``width`` channels, four Fourier layers, projected pointwise."""

    def __init__(self, in_channels: int = T_IN, out_channels: int = 1, width: int = WIDTH, modes: int = MODES,
                 layers: int = 4, projection: int = 128) -> None:
        super().__init__()
        self.in_channels, self.modes = in_channels, modes
        # lifting and projection are Linear layers over the channel axis as in the paper's code: a matmul with
        # one row per grid point sums each point the same way whatever the batch, where a 1x1 convolution of 3
        # to 12 input channels takes another kernel for a batch of one on a CPU (other bits)
        self.lift = nn.Linear(in_channels + 2, width)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.project = nn.Sequential(nn.Linear(width, projection), nn.GELU(), nn.Linear(projection, out_channels))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        # a: [B, C_in, H, W] -> u: [B, C_out, H, W]
        if a.dim() != 4 or a.shape[1] != self.in_channels:
            raise ValueError(f"fno: input must be [batch, {self.in_channels}, H, W], got {list(a.shape)}")
        h, w = a.shape[-2:]
        if min(h, w) < 2 * self.modes:
            raise ValueError(f"fno: the grid must be at least {2 * self.modes} points a side (2 x modes), got {h}x{w}")
        gy = torch.linspace(0, 1, h, device=a.device, dtype=a.dtype).view(1, 1, h, 1).expand(a.shape[0], 1, h, w)
        gx = torch.linspace(0, 1, w, device=a.device, dtype=a.dtype).view(1, 1, 1, w).expand(a.shape[0], 1, h, w)
        x = self.lift(torch.cat([a, gx, gy], dim=1).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # [B, width, H, W]
        for k, (spec, point) in enumerate(zip(self.spectral, self.pointwise)):
            x = spec(x) + point(x)
            if k < len(self.spectral) - 1:
                x = F.gelu(x)
        return self.project(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def build() -> FNO2d:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return FNO2d()


def make_request(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The last ``T_IN`` steps of a smooth vorticity field on an n x n grid, [1, T_IN, n, n]: a few random Fourier
    modes decaying and drifting in time (a stand-in for Navier-Stokes data)."""
    k = 4
    coef = torch.randn(k, k, generator=gen)
    drift = torch.rand(k, k, generator=gen)
    t = torch.linspace(0, 1, size)
    waves = torch.stack([torch.cos(torch.pi * (i + 1) * t) for i in range(k)])  # [k, n]
    steps = [torch.einsum("ij,ix,jy->xy", coef * torch.exp(-0.1 * s * drift), waves, waves) for s in range(T_IN)]
    return {"a": torch.stack(steps).unsqueeze(0)}


def collate(requests: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    shapes = {tuple(r["a"].shape) for r in requests}
    if len(shapes) != 1:
        raise ValueError(f"fno: a batch stacks grids of one resolution only, got {sorted(shapes)}")
    return {"a": torch.cat([r["a"] for r in requests])}


def split(out: torch.Tensor, requests: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return list(out.split(1))
