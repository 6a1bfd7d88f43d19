"""GPU benchmark: correctness first, then figures, then one table.

    PYTHONPATH=$PWD python3 -m bench gpu.suite [--out DIR] [--only SECTION,...]

The sections live in bench/gpu/, one module each over a shared harness (bench/gpu/harness.py), and take
their engine forms from the named presets of engine/config/presets.py:

1. Correctness on the GPU (correctness.py): each Triton kernel against its plain-torch reference (bf16); a
   tiny Llama and a tiny Qwen3-MoE through the engine (Triton kernels, CUDA graphs, decode run ahead of the
   host) against transformers' greedy tokens (fp32); a graph batch against each request alone.
2. Copy bandwidth and bf16 matmul throughput, measured in this run (machine.py).
3. Decode attention bandwidth at 4k and 32k context against torch SDPA; the decode projections' GEMV
   against cuBLAS; weights read into L2 ahead against the experts streaming through (machine.py).
4. Llama-3.1-8B-shaped model, random bf16 weights: batch-1 decode as a fraction of the roofline
   (weight + KV bytes per token over the copy bandwidth), against transformers with a static cache
   on the same weights (decode.py).
5. The same model: offline throughput on the Azure conversation trace's request lengths against
   transformers' eager batched generate; prefill MFU (throughput.py).
6. Cold start in a fresh process (python, imports, CUDA init, safetensors load, Triton JIT with an
   empty cache, graph capture, first token) against a forward hot swap prepared while serving (swap.py).
7. Qwen3-30B-A3B-shaped MoE, random bf16 weights: batch-1 decode against the active-parameter roofline
   (moe.py); the experts alone over their tiles (experts.py).
8. Weight precision (precision.py): the int8 / FP8 kernels against the float64 product; the 8B's batch-1 decode
   and prefill with int8 and FP8 weights against bf16, each against the roofline of its own bytes.
9. Where a quantized decode step's time goes (precision_step.py): each projection alone by precision, then
   whole steps of each precision in several decode forms and with tiles timed in the whole step.
10. The FP8 KV cache (kv_fp8.py): against the bf16 cache on a 4,000-token prompt, then batch decode at
    32,000 tokens of context and how many such sequences each cache holds.
11. Quantized weights as the tuner serves them (precision_serve.py): the activations' one-launch FP8
    quantization against the plain-torch path, then decode steps at 1-32 sequences for static-best in bf16 and
    with FP8 weights through the library's GEMM and through the Triton projections.
12. W8A8 FP8 prefill (precision/prefill.py): the activations' codes made by the norm and activation kernels, each
    projection at 32-8,192 rows in every FP8 form against cuBLAS bf16, the 8B's prefill and decode at 32-64 rows.

Every row is appended to DIR/gpu_bench.jsonl as soon as it is measured.
"""
from __future__ import annotations

import torch  # noqa: F401  (first: the cold start's child process times python start + import torch)

import sys

from bench.gpu.main import add_cli_args, main
from bench.lib import cli

if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
