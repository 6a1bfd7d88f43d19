"""CUDA graphs of whole steps that carry prefill tokens (a chunk of a prompt, or chunks beside decode rows), one per
token count of ``VariantSpec.prefill_graph_tokens``.

A prefill chunk in FP8 runs kernels shorter than the host's launches (``bench gpu.suite --only w8a8-host``): the
step goes at the host's pace. Replaying its forward as one graph takes the host out of it. A step of fewer tokens
is padded to the next captured count: padding tokens write their keys and values into the pool's scratch block and
belong to no sequence, so attention leaves their rows unwritten and no real row reads them (every other operation
of a dense model works row by row). The prefill attention kernel's tiles (kernels/attention/prefill_triton.py) come
from static buffers filled each step, padded with tiles of an empty sequence, which compute nothing. Only the
forward is captured: the logits of the sampling rows follow it eagerly (a middle chunk samples nothing, and an
lm_head over padded rows would read the vocabulary for nothing).

``capture=False`` runs the same static buffers eagerly (a CPU has no graphs): the padding and the buffers are
tested where the capture cannot run.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.attention.attention import AttentionMetadata
from kernels.attention.prefill_triton import tile_key, tile_order


class StepGraphs:
    def __init__(self, model, kv, kv_layers, cos_sin, ops, token_sizes, max_seqs: int, max_blocks_per_seq: int,
                 device, capture: bool = True) -> None:
        self.model, self.kv_layers, self.cos_sin, self.ops = model, kv_layers, cos_sin, ops
        self.sizes, self.max_seqs = sorted(set(token_sizes)), max_seqs
        self.block_size, self.scratch = kv.block_size, kv.scratch_block
        t, s = self.sizes[-1], max_seqs
        # per token: input id, position, KV slot; per sequence (and one more, the empty sequence padding tiles
        # point at): its block table, context length and query offsets (s + 2), then the attention's tiles
        self.tokens = torch.zeros((3, t), dtype=torch.int64, device=device)
        # until a step fills them, every KV write goes to the scratch block: a capture's warm-up runs while another
        # variant may be serving from the same pool
        self.tokens[2].fill_(self.scratch * kv.block_size)
        self.tables = torch.full((s + 1, max_blocks_per_seq), self.scratch, dtype=torch.int32, device=device)
        self.block_ms = self._warm_up(t, device)  # the tile heights the attention kernel asked for
        # one int32 buffer, one transfer: where each part lies in it, for the device views and the staging alike
        self._parts, at = {}, 0
        for name, n in [("context_lens", s + 1), ("query_start_loc", s + 2)] + [
                (part, -(-t // bm) + s) for bm in self.block_ms for part in (("seqs", bm), ("rows", bm))]:
            self._parts[name], at = slice(at, at + n), at + n  # a tile list: every sequence adds one partial tile
        self.ints = torch.zeros(at, dtype=torch.int32, device=device)
        self.context_lens = self.ints[self._parts["context_lens"]]
        self.query_start_loc = self.ints[self._parts["query_start_loc"]]
        self.tiles = {bm: (self.ints[self._parts["seqs", bm]], self.ints[self._parts["rows", bm]])
                      for bm in self.block_ms}
        self._stages = [_Staging(t, at, s + 1, max_blocks_per_seq) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        pool = None
        with torch.inference_mode():
            for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                if not capture:
                    self.graphs[n] = (None, None)
                    continue
                args = self._args(n)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # this size's launches once outside the capture
                    model(*args)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    hidden = model(*args)
                pool = graph.pool()
                self.graphs[n] = (graph, hidden)

    def _warm_up(self, t: int, device) -> list[int]:
        """One eager step of ``t`` tokens of one sequence over the scratch block: it compiles the kernels outside
        any capture, and the tiles its attention derived tell which tile heights to keep buffers for."""
        bs = self.block_size
        blocks = -(-t // bs)
        meta = AttentionMetadata.build(
            torch.full((t,), self.scratch * bs, dtype=torch.int64, device=device),
            torch.full((1, blocks), self.scratch, dtype=torch.int32, device=device), [t], [0, t], device)
        ids = torch.zeros(t, dtype=torch.int64, device=device)
        pos = torch.arange(t, dtype=torch.int64, device=device) % bs  # the scratch block's positions only
        with torch.inference_mode():
            self.model(ids, pos, self.cos_sin, self.kv_layers, meta, self.ops)
        return sorted(k[1] for k in meta.derived if isinstance(k, tuple) and len(k) == 2 and k == tile_key(k[1]))

    def _meta(self, n: int, context_lens: list[int], query_start_loc: list[int]) -> AttentionMetadata:
        """The step's metadata over the static buffers for a step of ``n`` tokens (captured: the host lists are
        the capture's and no kernel of the graph reads them)."""
        meta = AttentionMetadata(
            slot_mapping=self.tokens[2, :n], block_tables=self.tables, context_lens=context_lens,
            query_start_loc=query_start_loc, context_lens_t=self.context_lens, query_start_loc_t=self.query_start_loc,
            max_query_len=max(2, n), max_context_len=self.tables.shape[1] * self.block_size)
        for bm, (seqs, rows) in self.tiles.items():
            count = -(-n // bm) + self.max_seqs
            meta.derived[tile_key(bm)] = (count, seqs[:count], rows[:count])
        return meta

    def _args(self, n: int, context_lens: list[int] | None = None, query_start_loc: list[int] | None = None):
        s = self.max_seqs
        meta = self._meta(n, context_lens or [0] * (s + 1), query_start_loc or [0] * (s + 2))
        return self.tokens[0, :n], self.tokens[1, :n], self.cos_sin, self.kv_layers, meta, self.ops

    def fits(self, batch, ahead: bool = False) -> bool:
        """A step with prefill tokens (decode batches have their own graphs) that a captured size holds."""
        items = batch.scheduled
        return (not ahead and 0 < len(items) <= self.max_seqs and any(i.num_new_tokens > 1 for i in items)
                and sum(i.num_new_tokens for i in items) <= self.sizes[-1])

    def run(self, ids, positions, slots, tables: np.ndarray, context_lens: list[int], query_start_loc: list[int]
            ) -> torch.Tensor:
        """The step's hidden states, (T, hidden), from its packed inputs (``ModelRunner.host_inputs``): the inputs
        staged into pinned memory, copied in three contiguous transfers, the smallest captured size that holds them
        replayed (a view of its static output, which the next replay overwrites)."""
        n, b, s = len(ids), len(context_lens), self.max_seqs
        size = next(x for x in self.sizes if x >= n)
        staging = self._stages[self._turn]
        self._turn ^= 1
        staging.done.synchronize()  # the buffer's last copy has left
        tok, ints, tab = staging.tokens_np, staging.ints_np, staging.tables_np
        tok[0, :n], tok[1, :n], tok[2, :n] = ids, positions, slots
        tok[:2, n:size] = 0
        tok[2, n:size] = self.scratch * self.block_size
        ctx, qsl = ints[self._parts["context_lens"]], ints[self._parts["query_start_loc"]]
        ctx[:b], ctx[b:] = context_lens, 0
        qsl[:b + 1], qsl[b + 1:] = query_start_loc, n  # sequences past the step's: no new tokens
        for bm in self.block_ms:
            seq_buf, row_buf = ints[self._parts["seqs", bm]], ints[self._parts["rows", bm]]
            count = -(-size // bm) + s
            seq_ids, rows = tile_order(context_lens, query_start_loc, bm)
            k = len(seq_ids)
            seq_buf[:k], seq_buf[k:count] = seq_ids, s  # padding tiles: the empty sequence s
            row_buf[:k], row_buf[k:count] = rows, 0
        tab[:b, :tables.shape[1]] = tables
        # whole rows: a contiguous copy from pinned memory does not wait for the stream (what lies past the step's
        # tokens and blocks is stale, and nothing reads it)
        self.tokens.copy_(staging.tokens, non_blocking=True)
        self.ints.copy_(staging.ints, non_blocking=True)
        self.tables[:b].copy_(staging.tables[:b], non_blocking=True)
        staging.done.record()
        graph, hidden = self.graphs[size]
        if graph is None:  # not captured: the same buffers, eagerly
            padded_ctx = list(context_lens) + [0] * (s + 1 - b)
            padded_qsl = list(query_start_loc) + [n] * (s + 1 - b)
            with torch.inference_mode():
                return self.model(*self._args(size, padded_ctx, padded_qsl))[:n]
        graph.replay()
        return hidden[:n]


class _Staging:
    """Pinned host copies of the step's inputs, and the event of their last transfer to the device."""

    def __init__(self, tokens: int, ints: int, seqs: int, max_blocks: int) -> None:
        pin = torch.cuda.is_available()
        self.tokens = torch.zeros((3, tokens), dtype=torch.int64, pin_memory=pin)
        self.ints = torch.zeros(ints, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.zeros((seqs, max_blocks), dtype=torch.int32, pin_memory=pin)
        self.tokens_np, self.ints_np, self.tables_np = self.tokens.numpy(), self.ints.numpy(), self.tables.numpy()
        self.done = torch.cuda.Event() if pin else _Done()
        self.done.record()


class _Done:
    """An event's stand-in where copies are synchronous (no CUDA)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass
