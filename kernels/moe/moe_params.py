"""The Triton MoE kernels' tunable parameters: ``MoeParams`` (``moe_triton``) and ``NormMoeParams``
(``norm_moe_triton``), frozen and checked when built.

A variant's ``moe`` / ``norm_moe`` parameters arrive as a dict (``from_params`` names an unknown one); a
direct call may replace fields by name (``replace``). Every field is an integer: a tile size or count, or a
switch with a few choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

# the choices of the switch-like parameters; every other one is a positive tile size or count
_CHOICES = {"decode_split_down": (0, 1, 2, 3), "decode_down_early": (0, 1), "decode_route_rank": (0, 1),
            "decode_evict": (0, 1), "decode_act": (0, 1), "pdl": (0, 1, 2), "route_by_last": (0, 1)}
_POW2 = ("block_m", "block_n", "block_k", "decode_block_n", "decode_block_k", "decode_down_block_n", "decode_warps",
         "decode_down_block_k", "router_block_n", "router_block_k", "router_warps")
# counts for which 0 has a meaning: the down kernel's chunk as the gate/up kernel's; no eager batch on the
# decode path
_ZERO_ALLOWED = ("decode_down_block_k", "max_decode_pairs")


@dataclass(frozen=True)
class MoeParams:
    """``moe_triton``'s parameters. Up to ``max_decode_pairs`` routed (token, slot) pairs (any number while a
    CUDA graph is captured) take the device-only decode path (``decode_*``); more take the grouped matmul
    (``block_*``)."""

    # the grouped path: pairs per tile (sorted by expert), output columns and reduction chunk per program
    block_m: int = 16
    block_n: int = 32
    block_k: int = 32
    # the most routed pairs of an eager batch that take the decode path (0: none)
    max_decode_pairs: int = 64
    # the decode path's gate/up kernel: rows and reduction chunk per program
    decode_block_n: int = 8
    decode_block_k: int = 256
    # the down kernel's rows per program (with 3, the one-launch experts' down tile)
    decode_down_block_n: int = 8
    decode_warps: int = 4
    # 0: one down-projection program row per token looping over its k experts; 1: one per pair, summed by
    # another launch; 2: one per pair, summed by the last of a token's k programs; 3: routing, gate/up, down and
    # the sum in one launch (slower than 2 at batch 1 on an H200: bench/RESULTS.md)
    decode_split_down: int = 1
    # 1: the split down kernel requests its weights before it waits for the gate/up kernel, which then waits
    # before letting it be scheduled
    decode_down_early: int = 0
    # the down kernel's chunk of the intermediate (0: as decode_block_k)
    decode_down_block_k: int = 0
    # how many chunks ahead the decode loops request (1: none)
    decode_stages: int = 1
    # with decode_split_down 3: rows of the intermediate per program
    decode_chunk: int = 32
    # 1: the routing kernel's top k from every expert's rank at once (four warps) instead of k serial reductions
    # (one warp; measured slower at batch 1 on an H200: bench/RESULTS.md)
    decode_route_rank: int = 0
    # 1: the experts' weights read with the L2 "evict first" policy (streamed through once, so they do not push
    # out of L2 what other kernels read again)
    decode_evict: int = 0
    # 1: each gate/up program reads matching gate and up rows and writes their activation, so the down programs
    # read half as much and compute no activation
    decode_act: int = 0
    # the decode path's kernels with programmatic dependent launch (kernels/pdl.py): 1, wait, then let the next
    # kernel be scheduled; 2, the other way round
    pdl: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            k, v = f.name, getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"moe parameter {k} must be an integer, got {v!r}")
            if k in _CHOICES:
                if v not in _CHOICES[k]:
                    raise ValueError(f"moe parameter {k} must be one of {', '.join(map(str, _CHOICES[k]))}, got {v}")
            elif v < (0 if k in _ZERO_ALLOWED else 1):
                raise ValueError(f"moe parameter {k} must be positive, got {v}")
            if k in _POW2 and v & (v - 1):
                raise ValueError(f"moe parameter {k} must be a power of two, got {v}")
        if self.decode_act and self.decode_split_down == 3:
            raise ValueError("moe decode_act needs decode_split_down 0, 1 or 2 (the one-launch experts apply the "
                             "activation themselves)")

    @classmethod
    def from_params(cls, params: Mapping[str, int]) -> MoeParams:
        """A variant's parameters (name -> value): ``ValueError`` names an unknown one, one out of its range, or a
        combination the kernels do not have (the activation in gate/up with the one-launch experts)."""
        known = cls.names()
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown moe parameters {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(**params)

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes: int) -> MoeParams:
        """These parameters with ``changes``; ``TypeError`` names an unknown one (as a function's keywords)."""
        unknown = set(changes) - self.names()
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown parameters {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class NormMoeParams(MoeParams):
    """``norm_moe_triton``'s parameters: ``moe_triton``'s, and for a decode batch (at most 4 tokens and
    ``max_decode_pairs`` pairs) the one launch of the residual add, RMSNorm and router."""

    # the router: experts per program, reduction chunk (at least the hidden size: the row read once), warps
    router_block_n: int = 2
    router_block_k: int = 512
    router_warps: int = 4
    # 1: routing by the router launch's last program; 0: by the routing kernel after it
    route_by_last: int = 1
