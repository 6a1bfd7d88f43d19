"""One forward pass of the scheduled batch: pack inputs, run the model with the active ops, pick logits."""
from __future__ import annotations

import numpy as np
import torch

from engine.config.model_config import ModelConfig
from engine.model.forward_ops import ForwardOps
from engine.model.transformer import CausalLM
from kernels.attention.attention import AttentionMetadata, device_ints
from engine.model.rope import rope_cos_sin
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.step_graphs import StepGraphs
from engine.sched.output import SchedulerOutput


class KVCache:
    """The paged KV pool: per layer a key and a value tensor of (num_blocks + 1, block_size, KVH, D).

    Block ``num_blocks`` is a scratch block the block manager never hands out: padding rows of
    a CUDA-graph batch write their keys and values there.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.scratch_block = num_blocks
        shape = (cfg.num_hidden_layers, 2, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.pool = torch.zeros(shape, device=device, dtype=dtype)

    def poison(self, block_ids: list[int], value: float = float("nan")) -> None:
        """Fills blocks with garbage: a correct engine overwrites every slot before it reads it."""
        self.pool[:, :, block_ids] = value

    def release(self) -> None:
        """Frees the pool (a swap whose new pool does not fit beside it); the cache is unusable until replaced."""
        self.pool = None

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.pool[i, 0], self.pool[i, 1]) for i in range(self.pool.shape[0])]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, kv: KVCache, max_model_len: int, device) -> None:
        self.model, self.config, self.kv, self.device = model, cfg, kv, device
        self.max_model_len = max_model_len
        self.cos_sin = rope_cos_sin(cfg, max_model_len, device)
        self.kv_layers = kv.layers()
        self.graphs: DecodeGraphs | None = None  # captured decode steps of the active variant, on a GPU
        self.step_graphs: StepGraphs | None = None  # captured steps with prefill tokens, likewise
        self.forward_fn = model  # the model itself, or a torch.compile'd wrapper of it
        # (N,) int64 on the device: the greedy token of each sampling row of the last step, once asked for
        # (a graph replay computes it itself); the input of a step run ahead of that one's results
        self.greedy_tokens: torch.Tensor | None = None

    @torch.inference_mode()
    def warm_up(self, ops: ForwardOps, kv: KVCache | None = None, forward_fn=None) -> None:
        """One forward of a single token through ``ops`` over the pool's scratch block: compiles the
        kernels of a new variant before it serves anyone, and surfaces their errors."""
        kv = kv or self.kv
        slot = kv.scratch_block * kv.block_size
        meta = AttentionMetadata.build(torch.tensor([slot], device=self.device),
                                       torch.tensor([[kv.scratch_block]], dtype=torch.int32, device=self.device),
                                       [1], [0, 1], self.device)
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        hidden = (forward_fn or self.forward_fn)(ids, ids, self.cos_sin, kv.layers(), meta, ops)
        self.model.compute_logits(hidden, ops)

    def set_kv(self, kv: KVCache) -> None:
        self.kv, self.kv_layers = kv, kv.layers()

    def drop_kv(self) -> None:
        """Lets go of the pool and what was captured over it (before the pool is released)."""
        self.graphs, self.step_graphs, self.kv_layers = None, None, []

    def install(self, forward_fn, graphs: "tuple[DecodeGraphs | None, StepGraphs | None] | None") -> None:
        """A prepared variant's forward (the model or its compiled wrapper) and graphs (decode steps, steps with
        prefill tokens), made active."""
        self.forward_fn = forward_fn
        self.graphs, self.step_graphs = graphs or (None, None)

    def capture_graphs(self, ops: ForwardOps, batch_sizes: tuple[int, ...], kv: KVCache | None = None) -> "DecodeGraphs":
        """Captures decode steps for ``batch_sizes`` with ``ops`` over ``kv`` (default: the current pool)."""
        kv = kv or self.kv
        return DecodeGraphs(self.model, kv, kv.layers(), self.cos_sin, ops, batch_sizes,
                            -(-self.max_model_len // kv.block_size), self.device)

    def capture_step_graphs(self, ops: ForwardOps, token_sizes: tuple[int, ...], max_seqs: int,
                            kv: KVCache | None = None, capture: bool = True) -> StepGraphs:
        """Captures steps with prefill tokens of ``token_sizes`` tokens and up to ``max_seqs`` sequences
        (``capture=False``: the same buffers run eagerly)."""
        kv = kv or self.kv
        return StepGraphs(self.model, kv, kv.layers(), self.cos_sin, ops, token_sizes, max_seqs,
                          -(-self.max_model_len // kv.block_size), self.device, capture)

    def prepare(self, batch: SchedulerOutput, ahead: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Packed inputs of the batch on the device (``host_inputs``)."""
        ids, pos, slots, tables, ctx_lens, qsl, logits_idx = self.host_inputs(batch, ahead)
        dev = self.device
        attn = AttentionMetadata.build(
            device_ints(slots, torch.int64, dev), device_ints(tables, torch.int32, dev), ctx_lens, qsl, dev,
        )
        return device_ints(ids, torch.int64, dev), device_ints(pos, torch.int64, dev), attn, logits_idx

    def host_inputs(self, batch: SchedulerOutput, ahead: bool = False):
        """Packed inputs of the batch on the host: (token ids, positions, KV slots, block tables, context lengths,
        query offsets, the rows whose logits are sampled). ``ahead``: each row starts one token past its
        ``num_computed_tokens``, whose value is not known on the host yet (the ids are then placeholders)."""
        bs = self.kv.block_size
        ids: list[int] = []
        starts, counts, ctx_lens, qsl, logits_idx = [], [], [], [0], []
        for item in batch.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens + int(ahead)
            if ahead:
                ids.extend([0] * n)
            elif item.draft:  # the last token, then the draft to verify
                ids.append(seq.token_ids[start])
                ids.extend(item.draft)
            else:
                ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            counts.append(n)
            ctx_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            if item.samples:  # the last position; with a draft, every position
                logits_idx.extend(range(qsl[-1] - 1 - len(item.draft), qsl[-1]))
        width = max(len(item.seq.block_table) for item in batch.scheduled)
        tables = np.asarray([item.seq.block_table + [0] * (width - len(item.seq.block_table))
                             for item in batch.scheduled], dtype=np.int32)
        # each token's position and KV slot in array operations (a prefill step packs thousands of tokens)
        row = np.repeat(np.arange(len(counts)), counts)
        pos = np.repeat(np.asarray(starts, dtype=np.int64) - np.asarray(qsl[:-1], dtype=np.int64), counts) \
            + np.arange(qsl[-1], dtype=np.int64)
        slots = tables[row, pos // bs].astype(np.int64) * bs + pos % bs
        return ids, pos, slots, tables, ctx_lens, qsl, logits_idx

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput, ops: ForwardOps, ahead: bool = False) -> torch.Tensor:
        """Returns float32 logits for the sequences that sample, in schedule order: (N, vocab); a row with a
        draft has 1 + len(draft) of them, one per position.

        ``ahead``: a decode batch of the same rows as the step before, launched before that step's
        tokens reached the host; its input tokens are that step's ``greedy_tokens``.
        """
        prev = self.greedy_tokens
        self.greedy_tokens = None
        if self.graphs is not None and self.graphs.fits(batch):
            logits, self.greedy_tokens = self.graphs.run(batch, ahead, prev)
            return logits
        if self.step_graphs is not None and self.step_graphs.fits(batch, ahead):
            ids, pos, slots, tables, ctx_lens, qsl, logits_idx = self.host_inputs(batch)
            hidden = self.step_graphs.run(ids, pos, slots, tables, ctx_lens, qsl)
        else:
            input_ids, positions, attn, logits_idx = self.prepare(batch, ahead)
            if ahead:
                input_ids = prev
            hidden = self.forward_fn(input_ids, positions, self.cos_sin, self.kv_layers, attn, ops)
        if not logits_idx:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        if len(logits_idx) == hidden.shape[0]:  # every token samples (decode): no gather
            return self.model.compute_logits(hidden, ops)
        return self.model.compute_logits(hidden[device_ints(logits_idx, torch.int64, hidden.device)], ops)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """(N,) int64 on the device: the argmax of each row of the last step's logits."""
        if self.greedy_tokens is None:
            self.greedy_tokens = logits.argmax(dim=-1)
        return self.greedy_tokens
