"""CUDA graphs of the decode step, one per batch size the variant lists.

A decode step launches hundreds of small kernels; replaying a captured graph removes the
host work between them. Inputs live in static buffers that each replay overwrites. A batch
smaller than a captured size is padded: padding rows write their KV into the pool's scratch
block and their logits are dropped. Only kernels that read sequence lengths from device
tensors can be captured (the Triton attention kernels do; the plain-torch reference loops
over host values).

Each graph also takes the greedy token of every row (argmax of its logits) and writes it into
the input-ids buffer, so the next step of the same rows can be replayed before the host has
seen those tokens ("ahead"): only positions, slots and block tables come from the host, and
they do not depend on token values. The argmax is kernels/pointwise/argmax_triton.py's one launch (torch's
answer, tested against it), torch's own where Triton cannot run.
"""
from __future__ import annotations

import torch

from kernels.attention.attention import AttentionMetadata


class DecodeGraphs:
    def __init__(self, model, kv, kv_layers, cos_sin, ops, batch_sizes, max_blocks_per_seq, device) -> None:
        self.model, self.kv, self.sizes = model, kv, sorted(set(batch_sizes))
        self.block_size = kv.block_size
        self.device = device
        n = self.sizes[-1]
        scratch_slot = kv.scratch_block * kv.block_size
        # rows: positions, KV slots, context lengths, input ids; staged on the host, copied in one transfer
        # (an ahead step copies the first three rows only: its input ids are the previous replay's tokens)
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.positions, self.slot_mapping, self.context_lens, self.input_ids = self.inputs
        self.slot_mapping.fill_(scratch_slot)
        self.context_lens.fill_(1)
        self.block_tables = torch.full((n, max_blocks_per_seq), kv.scratch_block, dtype=torch.int32, device=device)
        # Two pinned staging buffers used in turn; each one's event marks its last copy done, so the host
        # never rewrites a buffer whose copy to the device is still queued.
        self._stages = [_Staging(n, max_blocks_per_seq, kv.scratch_block) for _ in range(2)]
        self._turn = 0
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        self._argmax = None  # (argmax_rows, its workspace), sized by the first warm-up's logits
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
                    # warm-up: Triton compiles outside the capture
                    self._write_greedy(model.compute_logits(model(*args), ops), b)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the engine may keep serving from another thread while this captures
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = model.compute_logits(model(*args), ops)
                    self._write_greedy(logits, b)
                pool = graph.pool()
                self.graphs[b] = (graph, logits)
        # padding rows must not keep the capture's values pointing at real blocks
        self.slot_mapping.fill_(scratch_slot)
        self.block_tables.fill_(kv.scratch_block)
        self.context_lens.fill_(1)

    def _write_greedy(self, logits: torch.Tensor, b: int) -> None:
        if self._argmax is None:
            self._argmax = _greedy_kernel(self.sizes[-1], logits.shape[-1], self.device) or False
        if self._argmax and logits.shape[-1] == self._argmax[1].n and logits.stride(-1) == 1:
            self._argmax[0](logits, self.input_ids[:b], self._argmax[1])
        else:
            self.input_ids[:b].copy_(logits.argmax(dim=-1))

    def fits(self, batch) -> bool:
        return len(batch.scheduled) <= self.sizes[-1] and all(
            s.num_new_tokens == 1 and s.samples for s in batch.scheduled)

    def run(self, batch, ahead: bool = False, prev_tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the smallest captured graph that holds the batch.

        ``ahead``: every row computes the position after its ``num_computed_tokens`` (the step before is
        still in flight) from ``prev_tokens`` (B,), that step's greedy tokens on the device.
        Returns (B, vocab) float32 logits and the (B,) greedy tokens, both views of static buffers
        that the next replay overwrites.
        """
        b = len(batch.scheduled)
        size = next(s for s in self.sizes if s >= b)
        bs, scratch = self.block_size, self.kv.scratch_block
        staging = self._stages[self._turn]
        self._turn ^= 1
        staging.done.synchronize()
        stage, tables = staging.stage_np, staging.tables_np
        width = 1
        for i, item in enumerate(batch.scheduled):
            seq = item.seq
            p = seq.num_computed_tokens + int(ahead)
            table = seq.block_table
            stage[0, i], stage[1, i], stage[2, i] = p, table[p // bs] * bs + p % bs, p + 1
            if not ahead:
                n_prompt = len(seq.prompt_token_ids)
                stage[3, i] = seq.prompt_token_ids[p] if p < n_prompt else seq.output_token_ids[p - n_prompt]
            tables[i, : len(table)] = table
            width = max(width, len(table))
        # padding rows: token 0 at position 0, writing into the scratch block
        stage[0, b:size] = 0
        stage[1, b:size] = scratch * bs
        stage[2, b:size] = 1
        stage[3, b:size] = 0
        tables[b:size, :width] = scratch
        rows = 3 if ahead else 4
        self.inputs[:rows].copy_(staging.stage[:rows], non_blocking=True)
        # whole rows: a strided copy would stage through pageable memory, which waits for the stream
        self.block_tables[:size].copy_(staging.tables[:size], non_blocking=True)
        staging.done.record()
        if ahead and (prev_tokens is None or prev_tokens.data_ptr() != self.input_ids.data_ptr()):
            self.input_ids[:b].copy_(prev_tokens)  # the tokens came from an eager step, not from a replay
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:b], self.input_ids[:b]


class _Staging:
    """A pinned host copy of the graph inputs, and the event of its last transfer to the device."""

    def __init__(self, n: int, max_blocks_per_seq: int, scratch_block: int) -> None:
        self.stage = torch.zeros((4, n), dtype=torch.int64, pin_memory=True)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, pin_memory=True)
        self.stage_np, self.tables_np = self.stage.numpy(), self.tables.numpy()
        self.done = torch.cuda.Event()
        self.done.record()


def _greedy_kernel(rows: int, vocab: int, device):
    """(argmax_rows, its workspace) on a CUDA device where Triton runs; None elsewhere (torch's argmax)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        from kernels.pointwise.argmax_triton import ArgmaxWorkspace, argmax_rows
    except ImportError:
        return None
    return argmax_rows, ArgmaxWorkspace(rows, vocab, device)
