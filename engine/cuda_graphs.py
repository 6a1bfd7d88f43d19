"""CUDA graphs of the decode step, one per batch size the variant lists.

A decode step launches hundreds of small kernels; replaying a captured graph removes the
host work between them. Inputs live in static buffers that each replay overwrites. A batch
smaller than a captured size is padded: padding rows write their KV into the pool's scratch
block and their logits are dropped. Only kernels that read sequence lengths from device
tensors can be captured (the Triton attention kernels do; the plain-torch reference loops
over host values).
"""
from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, kv, kv_layers, cos_sin, ops, batch_sizes, max_blocks_per_seq, device) -> None:
        self.model, self.kv, self.sizes = model, kv, sorted(set(batch_sizes))
        self.block_size = kv.block_size
        self.device = device
        n = self.sizes[-1]
        scratch_slot = kv.scratch_block * kv.block_size
        # rows: input ids, positions, KV slots, context lengths; staged on the host, copied in one transfer
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.inputs
        self.slot_mapping.fill_(scratch_slot)
        self.context_lens.fill_(1)
        self.block_tables = torch.full((n, max_blocks_per_seq), kv.scratch_block, dtype=torch.int32, device=device)
        pin = torch.cuda.is_available()
        self._stage = torch.zeros((4, n), dtype=torch.int64, pin_memory=pin)
        self._tables = torch.full((n, max_blocks_per_seq), kv.scratch_block, dtype=torch.int32, pin_memory=pin)
        self._stage_np, self._tables_np = self._stage.numpy(), self._tables.numpy()
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                meta = AttentionMetadata(
                    slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
                    context_lens=[1] * b, query_start_loc=list(range(b + 1)),
                    context_lens_t=self.context_lens[:b], query_start_loc_t=self.query_start_loc[: b + 1],
                    max_query_len=1, max_context_len=max_blocks_per_seq * kv.block_size,
                )
                args = (self.input_ids[:b], self.positions[:b], cos_sin, kv_layers, meta, ops)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    model.compute_logits(model(*args))  # warm-up: Triton compiles outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model.compute_logits(model(*args))
                pool = graph.pool()
                self.graphs[b] = (graph, logits)
        # padding rows must not keep the capture's values pointing at real blocks
        self.slot_mapping.fill_(scratch_slot)
        self.block_tables.fill_(kv.scratch_block)
        self.context_lens.fill_(1)

    def fits(self, batch) -> bool:
        return len(batch.scheduled) <= self.sizes[-1] and all(
            s.num_new_tokens == 1 and s.samples for s in batch.scheduled)

    def run(self, batch) -> torch.Tensor:
        """Replays the smallest captured graph that holds the batch; returns (B, vocab) float32 logits."""
        b = len(batch.scheduled)
        size = next(s for s in self.sizes if s >= b)
        bs, scratch = self.block_size, self.kv.scratch_block
        stage, tables = self._stage_np, self._tables_np
        width = 1
        for i, item in enumerate(batch.scheduled):
            seq = item.seq
            p = seq.num_computed_tokens
            table = seq.block_table
            stage[0, i], stage[1, i] = seq.token_ids[p], p
            stage[2, i], stage[3, i] = table[p // bs] * bs + p % bs, p + 1
            tables[i, : len(table)] = table
            width = max(width, len(table))
        # padding rows: token 0 at position 0, writing into the scratch block
        stage[:, b:size] = 0
        stage[2, b:size] = scratch * bs
        stage[3, b:size] = 1
        tables[b:size, :width] = scratch
        self.inputs[:, :size].copy_(self._stage[:, :size], non_blocking=True)
        self.block_tables[:size, :width].copy_(self._tables[:size, :width], non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b]
