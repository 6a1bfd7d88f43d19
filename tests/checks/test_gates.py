"""The gates reject planted faults, each with a reason naming the failure, and pass clean variants (SmolLM2's first
8 layers: tests/conftest.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from checks.gates import GateSettings, factory_for, run_gates
from checks.prompts import shipped_prompts
from engine import EngineConfig, LLMEngine
from engine.sched.block_manager import BlockManager
from engine.config.source import ModelSource
from engine.config.variant import REFERENCE_VARIANT, VariantSpec
from kernels.pointwise.activation import silu_and_mul_ref
from kernels.attention.attention import paged_attention_ref
from ops.search.kernel_templates import KernelChoice

pytestmark = pytest.mark.slow  # SmolLM2 through the gates, many times

GEN_SILU = KernelChoice("silu_and_mul", "silu_tile", (("BLOCK_D", 64),))  # a templated Triton kernel
TINY = Path(__file__).parents[1] / "engine" / "tiny_moe" / "config.json"


@pytest.fixture(scope="module")
def base(smollm2_short):
    return smollm2_short


def _few(base) -> list[list[int]]:
    """Half the shipped prompts (short and long, prose and code) for the quality part: the faults show in them."""
    return shipped_prompts(base)[::2]


def _gate(base, make, fail_fast=True):
    """The gates on half the shipped prompts, 8 tokens each (the faults show within them)."""
    report = run_gates(factory_for(base, REFERENCE_VARIANT), make, reference_id="reference", candidate_id="planted",
                       dtype="float32", fail_fast=fail_fast, prompts=_few(base), max_tokens=8)
    print(report.summary())
    return report


def _with_ops(base, **ops):
    ref = factory_for(base, REFERENCE_VARIANT)

    def make(s: GateSettings) -> LLMEngine:
        eng = ref(s)
        eng.ops = eng.ops.replace(**ops)
        return eng
    return make


def _with_block_manager(base, cls):
    ref = factory_for(base, REFERENCE_VARIANT)

    def make(s: GateSettings) -> LLMEngine:
        eng = ref(s)
        bm = cls(eng.block_manager.num_blocks, eng.block_manager.block_size, eng.block_manager.enable_prefix_caching)
        eng.block_manager = eng.scheduler.block_manager = bm
        return eng
    return make


def _attention_keeping(keep):
    """Reference attention over a context whose key count is changed by ``keep(ctx, block_size)``."""
    def attn(q, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // kvh
        for i, ctx in enumerate(meta.context_lens):
            qs, qe = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            n, nk = qe - qs, keep(ctx, bs)
            nb = -(-nk // bs)
            table = meta.block_tables[i].long().tolist() + [0] * nb  # past the table: block 0
            blocks = torch.tensor(table[:nb])
            k = k_cache.index_select(0, blocks).view(-1, kvh, d)[:nk].permute(1, 2, 0)
            v = v_cache.index_select(0, blocks).view(-1, kvh, d)[:nk].transpose(0, 1)
            qi = q[qs:qe].view(n, kvh, group, d).permute(1, 0, 2, 3).reshape(kvh, n * group, d)
            scores = torch.matmul(qi, k) * scale
            qpos = torch.arange(ctx - n, ctx).repeat_interleave(group)[:, None]
            kpos = torch.arange(nk)[None, :]
            scores.masked_fill_((kpos > qpos) & (kpos < ctx), float("-inf"))
            o = torch.matmul(torch.softmax(scores, -1), v)
            out[qs:qe] = o.view(kvh, n, group, d).permute(1, 0, 2, 3).reshape(n, kvh * group, d)
        return out
    return attn


class StaleReuse(BlockManager):
    """Hands a cached block to a request whose prefix it does not hold, and skips computing it."""

    def match_prefix(self, seq):
        cached = super().match_prefix(seq)
        usable = (seq.num_tokens - 1) // self.block_size
        if len(seq.block_table) < usable:
            stale = next((b for b in self._free if self.blocks[b].hash is not None), None)
            if stale is not None:
                del self._free[stale]
                self.blocks[stale].ref_count += 1
                seq.block_table.append(stale)
                cached += self.block_size
                seq.num_computed_tokens = seq.num_cached_tokens = cached
        return cached


class PositionBlindHash(BlockManager):
    """Hashes a block's tokens without its prefix, so equal blocks at different positions collide."""

    def _hash(self, parent, token_ids):
        return super()._hash(None, token_ids)


def _wrong_when_batched(q, k_cache, v_cache, meta, scale):
    out = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if len(meta.context_lens) > 1:
        out[meta.query_start_loc[1]:] *= 1.05  # every sequence but the first is off
    return out


PLANTED = {
    "attention reads one block past the block table": (
        lambda base: _with_ops(base, attention=_attention_keeping(lambda ctx, bs: ctx + bs)),
        ("max |dlogit|",)),
    "attention drops the last partial block": (
        lambda base: _with_ops(base, attention=_attention_keeping(lambda ctx, bs: ctx - ctx % bs or ctx)),
        ("max |dlogit|",)),
    "cache hands out a reused block without the request's data": (
        lambda base: _with_block_manager(base, StaleReuse), ("prefix cache hits",)),
    "prefix-cache hash ignores the block's position": (
        lambda base: _with_block_manager(base, PositionBlindHash), ("interleaved, shared prefixes",)),
    "kernel with 1e-2 relative drift": (
        lambda base: _with_ops(base, silu_and_mul=lambda x: silu_and_mul_ref(x) * 1.01), ("max |dlogit|", "mean KL")),
    "right alone, wrong when batched": (lambda base: _with_ops(base, attention=_wrong_when_batched), ("batched",)),
}


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_is_rejected_with_a_reason(base, fault):
    build, names = PLANTED[fault]
    # the batched fault also fails quality (its prompts run batched there); run on to see the scenario name it
    report = _gate(base, build(base), fail_fast="batched" not in names)
    assert report.verdict == "fail"
    failed = " | ".join(report.reasons)
    for name in names:
        assert name in failed, f"{fault}: expected a failure naming {name!r}, got: {failed}"


def test_a_clean_variant_passes(base):
    spec = VariantSpec(name="chunked prefill", max_num_batched_tokens=24, max_num_seqs=3)
    report = run_gates(factory_for(base, REFERENCE_VARIANT), factory_for(base, spec), reference_id="reference",
                       candidate_id=spec.variant_id, dtype="float32", prompts=_few(base))
    print(report.summary())
    assert report.verdict == "pass", report.reasons
    assert len(report.contamination) == 5 and all(c.passed for c in report.contamination)
    print(f"gate run time on SmolLM2, CPU: {report.seconds:.1f} s")


def test_a_generated_kernel_variant_passes_on_a_tiny_model():
    """A templated Triton kernel, gated as agents' variants are; on a tiny model, since it runs interpreted here."""
    tiny = LLMEngine(EngineConfig(source=ModelSource("synthetic", TINY, seed=1), num_kv_blocks=64,
                                  load_tokenizer=False, variant=VariantSpec()))
    spec = VariantSpec(name="generated silu", kernels={"silu_and_mul": "generated:gate_silu.silu_and_mul"},
                       generated_source={"gate_silu": GEN_SILU.source()},
                       kernel_params={"silu_and_mul": dict(GEN_SILU.tiles)}, block_size=4)
    reference = dataclasses.replace(REFERENCE_VARIANT, block_size=4)
    prompts = [[(11 * i + 5 * j) % 60 + 2 for j in range(4 + 3 * i)] for i in range(3)]
    report = run_gates(factory_for(tiny, reference), factory_for(tiny, spec), reference_id="reference",
                       candidate_id=spec.variant_id, dtype="float32", prompts=prompts, max_tokens=4, block_size=4)
    print(report.summary())
    assert report.verdict == "pass", report.reasons
    assert len(report.contamination) == 5 and all(c.passed for c in report.contamination)


def test_exact_mode_demands_bit_identity(base):
    drift = _with_ops(base, silu_and_mul=lambda x: silu_and_mul_ref(x) * (1 + 1e-6))
    report = run_gates(factory_for(base, REFERENCE_VARIANT), drift, reference_id="reference", candidate_id="tiny",
                       dtype="float32", exact=True, prompts=_few(base), max_tokens=6)
    assert report.verdict == "fail" and any(r.startswith("exact") for r in report.reasons)
    assert report.contamination_skipped and not report.contamination and "not run" in report.summary()
    same = run_gates(factory_for(base, REFERENCE_VARIANT), factory_for(base, REFERENCE_VARIANT),
                     reference_id="reference", candidate_id="reference", dtype="float32", exact=True,
                     prompts=_few(base), max_tokens=6)
    assert same.verdict == "pass"


def test_check_cli_passes_clean_and_fails_drift(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[1] / "engine" / "tiny_moe"
    drift = GEN_SILU.source().replace("g * tl.sigmoid(g) * u", "g * tl.sigmoid(g) * u + 0.04")
    cases = {"clean": (VariantSpec(max_num_batched_tokens=16), 0),
             "drift": (VariantSpec(kernels={"silu_and_mul": "generated:drift.silu_and_mul"},
                                   kernel_params={"silu_and_mul": {"BLOCK_D": 64}},
                                   generated_source={"drift": drift}), 1)}
    for name, (spec, rc) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(spec.to_json()))
        out = tmp_path / f"{name}.report.json"
        r = subprocess.run([sys.executable, "-m", "pipelines.cli", "check", "--model", str(tiny), "--synthetic",
                            "--variant", str(path), "--json", str(out)], capture_output=True, text=True, timeout=600)
        assert r.returncode == rc, r.stdout + r.stderr
        report = json.loads(out.read_text())
        assert report["candidate_variant"] == spec.variant_id
        assert report["verdict"] == ("pass" if rc == 0 else "fail")
        if rc:
            assert any("max |dlogit|" in x for x in report["reasons"])
