"""A time-series forecaster shaped like PatchTST (Nie et al., "A Time Series is Worth 64 Words", the supervised
PatchTST/42 form): per-series instance normalization (RevIN), patching (length 16, stride 8, the end padded by
repeating the last value), a learned position embedding, a transformer encoder with BatchNorm, and a flatten
head to the horizon, every series handled on its own (channel independence).

A request is one multivariate series of ``size`` channels over the lookback window, [channels, LOOKBACK]; its
forecast is [channels, HORIZON]. Because no layer mixes channels, requests of any channel count share a forward
pass by concatenating their channels; ``pad`` adds copies of a real series up to a bounded row count when a variant
asks for few shapes, and ``split`` drops them.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from engine.workloads.padding import check_target, padded_count

LOOKBACK, HORIZON = 336, 96
PATCH, STRIDE = 16, 8
D_MODEL, HEADS, D_FF, LAYERS = 128, 16, 256, 3
SEED = 48
# the head's matmul has one row per series; a CPU BLAS sums a matrix of few rows with another kernel (in
# another order) than a tall one, so a series forecast alone would differ in its last bits from the same series
# batched with others. Padding the rows to this many (zeros, dropped after) keeps every batch on the tall path.
MIN_ROWS = 16


class EncoderLayer(nn.Module):
    """Post-norm transformer layer with BatchNorm over the model dimension, as PatchTST's TSTEncoderLayer."""

    def __init__(self, d: int = D_MODEL, heads: int = HEADS, d_ff: int = D_FF) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm_attn, self.norm_ff = nn.BatchNorm1d(d), nn.BatchNorm1d(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d))

    @staticmethod
    def _bn(norm: nn.BatchNorm1d, x: torch.Tensor) -> torch.Tensor:
        return norm(x.transpose(1, 2)).transpose(1, 2)  # BatchNorm1d wants [N, d, P]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N series, P patches, d]
        n, p, d = x.shape
        q, k, v = self.qkv(x).view(n, p, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # [N, h, P, dh]
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, d)
        x = self._bn(self.norm_attn, x + self.proj(a))
        return self._bn(self.norm_ff, x + self.ff(x))


class PatchTST(nn.Module):
    def __init__(self, lookback: int = LOOKBACK, horizon: int = HORIZON, patch: int = PATCH, stride: int = STRIDE,
                 d: int = D_MODEL, layers: int = LAYERS) -> None:
        super().__init__()
        self.lookback, self.patch, self.stride = lookback, patch, stride
        self.n_patches = (lookback - patch) // stride + 2  # +1 for the end padding of one stride
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.empty(self.n_patches, d).uniform_(-0.02, 0.02))
        self.layers = nn.ModuleList(EncoderLayer(d) for _ in range(layers))
        self.head = nn.Linear(self.n_patches * d, horizon)
        self.revin_weight = nn.Parameter(torch.ones(1))
        self.revin_bias = nn.Parameter(torch.zeros(1))
        with torch.no_grad():  # a trained model's BatchNorm statistics are not 0 and 1: draw some
            for m in self.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.running_mean.normal_(0, 0.1)
                    m.running_var.uniform_(0.5, 2.0)
                    m.weight.uniform_(0.8, 1.2)

    def encode(self, series: torch.Tensor) -> torch.Tensor:
        """[N, lookback] normalized series -> [N, P, d] encoder output."""
        padded = torch.cat([series, series[:, -1:].expand(-1, self.stride)], 1)
        patches = padded.unfold(1, self.patch, self.stride)  # [N, P, patch]
        x = self.embed(patches) + self.pos
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, series: torch.Tensor) -> torch.Tensor:
        # series: [N channels, lookback] -> forecast [N, horizon]
        if series.dim() != 2 or series.shape[1] != self.lookback:
            raise ValueError(f"patchtst: input must be [channels, {self.lookback}], got {list(series.shape)}")
        mean = series.mean(1, keepdim=True)
        std = (series.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt()
        z = (series - mean) / std * self.revin_weight + self.revin_bias
        y = self.head(rows_at_least(self.encode(z).flatten(1), MIN_ROWS))[: series.shape[0]]
        return (y - self.revin_bias) / (self.revin_weight + 1e-10) * std + mean


def rows_at_least(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [N, K] with zero rows appended up to ``rows`` (itself when it has that many)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def build() -> PatchTST:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return PatchTST()


def make_request(size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``size`` series of daily and weekly seasonality (hourly samples) with a trend and noise, as in ETT data."""
    t = torch.arange(LOOKBACK, dtype=torch.float32)
    amp, phase, trend, level = (torch.rand(size, 1, generator=gen) for _ in range(4))
    x = (level * 10 + trend * t / LOOKBACK + amp * torch.sin(2 * math.pi * t / 24 + 6 * phase)
         + 0.5 * amp * torch.sin(2 * math.pi * t / 168) + 0.1 * torch.randn(size, LOOKBACK, generator=gen))
    return {"series": x}


def collate(requests: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"series": torch.cat([r["series"] for r in requests])}


def pad(batch: dict[str, torch.Tensor], rows: int | None = None) -> dict[str, torch.Tensor]:
    """The collated batch with copies of its last series appended up to ``rows`` (default: ``padded_count`` of
    its own). Copies, not zeros: RevIN divides by each series' standard deviation, which a constant row has none
    of; a copy's forecast is a real one's, and the channels never mix, so no real forecast changes."""
    series = batch["series"]  # [N, LOOKBACK]
    n = series.shape[0]
    rows = padded_count(n) if rows is None else rows
    check_target("series", n, rows)
    if rows == n:
        return batch
    return {**batch, "series": torch.cat([series, series[-1:].expand(rows - n, -1)])}


def split(out: torch.Tensor, requests: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each request's forecast [its series, HORIZON]; rows past the requests' own (``pad``'s copies) are dropped."""
    sizes = [r["series"].shape[0] for r in requests]
    return list(out[:sum(sizes)].split(sizes))
