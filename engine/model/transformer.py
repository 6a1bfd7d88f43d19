"""The decoder-only transformer shared by every supported family.

Tokens of all scheduled sequences are packed into one flat batch of T tokens; the
paged KV cache and ``AttentionMetadata`` say which sequence each token belongs to.
Every numeric operation goes through a ``ForwardOps`` table so that a variant can
replace kernels without touching the weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model_config import ModelConfig
from engine.model.forward_ops import ForwardOps
from kernels.attention.attention import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        self.tp = None  # a TPGroup when the heads are split across ranks (engine.model.parallel)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(self.head_dim))
            self.k_norm = nn.Parameter(torch.empty(self.head_dim))

    def forward(
        self,
        qkv: torch.Tensor,  # (T, (H + 2 KVH) * D), the QKV projection of the normed input
        positions: torch.Tensor,  # (T,)
        cos_sin: torch.Tensor,  # (P, 2, head_dim / 2)
        kv: tuple[torch.Tensor, torch.Tensor],  # each (num_blocks, block_size, KVH, D)
        attn: AttentionMetadata,
        ops: ForwardOps,
        next_qkv: torch.Tensor | None = None,  # the next layer's QKV weight (a prefetch hint), None for the last
    ) -> torch.Tensor:
        t = qkv.shape[0]
        join = ops.prefetch((self.o_proj.weight,), t, "o_proj")  # read while the attention runs (a hint)
        ops.prefetch((next_qkv,), t, "next_qkv_early")  # after it, same stream; joined at the step's end
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        o = ops.rotary_attention(q, k, v, q_norm, k_norm, self.eps, positions, cos_sin, kv[0], kv[1], attn, self.scale)
        join()
        out = ops.linear(o.reshape(t, q_size), self.o_proj.weight)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.tp = None  # a TPGroup when the intermediate columns are split across ranks

    def forward(self, gate_up: torch.Tensor, ops: ForwardOps) -> torch.Tensor:
        """gate_up: (T, 2I), the gate/up projection of the normed input."""
        out = ops.act_linear(gate_up, self.down_proj.weight)
        return out if self.tp is None else self.tp.all_reduce(out)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # [gate | up] per expert
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.tp = None  # a TPGroup when every expert's intermediate columns are split across ranks

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                ops: ForwardOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the attention's output; returns (this block's output, x + residual), normed with ``norm_weight``."""
        out, residual = ops.norm_moe(x, residual, norm_weight, eps, self.gate.weight, self.w13, self.w2, self.top_k,
                                     self.renormalize)
        return (out if self.tp is None else self.tp.all_reduce(out)), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.mlp = MoE(cfg) if cfg.layer_is_moe(index) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, positions, cos_sin, kv, attn, ops, next_qkv=None):
        """x: (T, hidden), the previous layer's output; residual: the running sum, None before the first layer;
        next_qkv: the next layer's QKV weight (a prefetch hint while this layer's MLP runs), None for the last."""
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = x
            qkv = ops.linear(ops.rms_norm(x, self.input_layernorm, self.eps), qkv_proj.weight, qkv_proj.bias)
        else:
            qkv, residual = ops.norm_linear(x, residual, self.input_layernorm, self.eps, qkv_proj.weight,
                                            qkv_proj.bias)
        h = self.self_attn(qkv, positions, cos_sin, kv, attn, ops, next_qkv)
        join = ops.prefetch((next_qkv,), h.shape[0], "next_qkv")
        if isinstance(self.mlp, MoE):
            out, residual = self.mlp(h, residual, self.post_attention_layernorm, self.eps, ops)
        else:
            gate_up, residual = ops.norm_linear(h, residual, self.post_attention_layernorm, self.eps,
                                                self.mlp.gate_up_proj.weight)
            out = self.mlp(gate_up, ops)
        join()
        return out, residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, lm_head_rows: int | None = None) -> None:
        """``lm_head_rows``: the vocabulary rows this rank's lm_head holds (tensor parallel); default all."""
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(lm_head_rows or cfg.vocab_size, cfg.hidden_size))
        self.tp = None  # a TPGroup when the weights are split across ranks (engine.model.parallel.shard_model)
        self.vocab_split = False  # lm_head holds this rank's vocabulary rows; logits are gathered

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) pair per layer
        attn: AttentionMetadata,
        ops: ForwardOps,
    ) -> torch.Tensor:
        """Returns the final hidden states, (T, hidden)."""
        x, residual = self.embed_tokens(input_ids), None
        layers = list(self.layers)
        try:
            for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
                nxt = layers[i + 1].self_attn.qkv_proj.weight if i + 1 < len(layers) else None
                x, residual = layer(x, residual, positions, cos_sin, kv, attn, ops, nxt)
            x, _ = ops.fused_add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)
        except BaseException:
            ops.prefetch((), x.shape[0], "abort")()  # the side stream's deferred reads forgotten, not waited for
            raise
        ops.prefetch((), x.shape[0], "end")()  # the side stream's deferred reads joined before the step ends
        return x

    def compute_logits(self, hidden: torch.Tensor, ops: ForwardOps | None = None) -> torch.Tensor:
        """hidden: (N, hidden) -> logits (N, vocab) in float32, through ``ops.linear`` when given."""
        logits = (ops.linear if ops is not None else F.linear)(hidden, self.lm_head_weight())
        if self.vocab_split:
            logits = self.tp.gather_columns(logits)
        return logits.float()
