"""A concat workload's rows padded to a bounded grid when a variant asks for buckets: the rounding, each model's
pad hook (real outputs unchanged, nothing non-finite, few shapes where the raw batches have many), the runner
applying it only then, and bad targets refused."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.workloads import WorkloadVariant, build_runner, get_workload
from engine.workloads.padding import padded_count

CONCAT = ("patchtst", "protein_e3nn")
# request sizes drawn for the tests: any size up to the largest recorded level, not only the levels
MAX_DRAWN = {"patchtst": 21, "protein_e3nn": 192}
BUCKETED = WorkloadVariant(max_batch=8, bucket_sizes=(1, 2, 4, 8))


@pytest.fixture(scope="module")
def modules():
    return {}


def setup(modules: dict, name: str):
    if name == "protein_e3nn":
        pytest.importorskip("e3nn")
    w = get_workload(name)
    if name not in modules:
        modules[name] = w.build()
    return w, modules[name]


def draw(w, rng: random.Random, most: int = 8) -> list[int]:
    return [rng.randint(w.min_size, MAX_DRAWN[w.name]) for _ in range(rng.randint(1, most))]


def shape_of(batch: dict[str, torch.Tensor]) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()))


def test_padded_count_is_monotone_bounded_and_coarse():
    for per_octave, most in ((1, 13), (2, 24), (4, 44)):
        counts = [padded_count(n, per_octave) for n in range(4097)]
        assert counts[0] == 0 and all(a <= b for a, b in zip(counts, counts[1:]))
        assert all(n <= c < n * (1 + 1 / per_octave) or c == n for n, c in enumerate(counts))
        assert len(set(counts[1:])) == most
    assert [padded_count(n) for n in (8, 9, 17, 33, 100)] == [8, 10, 20, 40, 112]
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="non-negative integer"):
            padded_count(bad)
    with pytest.raises(ValueError, match="power of two"):
        padded_count(10, 3)


@pytest.mark.parametrize("name", CONCAT)
def test_padded_batches_keep_every_real_output_and_stay_finite(modules, name):
    w, module = setup(modules, name)
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    plain = build_runner(w, WorkloadVariant(max_batch=8), module, "cpu")
    bucketed = build_runner(w, BUCKETED, module, "cpu")
    for _ in range(2):
        sizes = draw(w, rng)
        reqs = w.make_inputs(sizes, rng.randrange(2**31))
        ref, out = plain(reqs), bucketed(reqs)
        for r, a, b in zip(reqs, ref, out):
            assert a.shape == b.shape and a.shape[0] == r.size
            assert torch.isfinite(b).all()
            torch.testing.assert_close(b, a, atol=1e-5 * max(a.abs().max().item(), 1.0), rtol=0.0)
        batch = w.collate([r.tensors for r in reqs])
        padded = w.pad(batch)
        with torch.inference_mode():
            y = module(**padded)
        assert torch.isfinite(y).all(), "a padded row's output is not finite"  # the dummies' own rows included


# patchtst: at most the 26 grid values up to 8 * 21 series; protein_e3nn: (residues, edges) pairs, 26 to 32 seen
@pytest.mark.parametrize("name, raw_least, padded_most", [("patchtst", 40, 26), ("protein_e3nn", 90, 40)])
def test_padded_shapes_take_few_values_where_raw_ones_take_many(modules, name, raw_least, padded_most):
    w = get_workload(name)
    if name == "protein_e3nn":
        pytest.importorskip("e3nn")
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    raw, padded = set(), set()
    for _ in range(100):
        batch = w.collate([r.tensors for r in w.make_inputs(draw(w, rng), rng.randrange(2**31))])
        raw.add(shape_of(batch))
        padded.add(shape_of(w.pad(batch)))
    assert len(raw) >= raw_least and len(padded) <= padded_most, (len(raw), len(padded))


def test_protein_dummies_are_distinct_far_and_receive_every_dummy_edge():
    pytest.importorskip("e3nn")
    w = get_workload("protein_e3nn")
    batch = w.collate([r.tensors for r in w.make_inputs([40, 33], 5)])
    n, e = batch["pos"].shape[0], batch["edge_index"].shape[1]
    padded = w.pad(batch)
    nodes, edges = padded["pos"].shape[0], padded["edge_index"].shape[1]
    assert nodes == padded_count(n + 2, 1) and edges == padded_count(e) and edges > e
    src, dst = padded["edge_index"][:, e:]
    assert (src >= n).all() and (dst >= n).all() and (src != dst).all()
    assert torch.equal(padded["edge_index"][:, :e], batch["edge_index"])
    dummies = padded["pos"][n:]
    assert (dummies[:, 0] >= 1e4).all() and (padded["types"][n:] == 0).all()


def test_runner_pads_concat_batches_only_with_buckets(modules):
    w, module = setup(modules, "patchtst")
    reqs = w.make_inputs([3, 7, 1], 9)  # 11 series: 12 in the bucket's padded batch
    seen = []

    def record(runner):
        inner = runner.forward
        runner.forward = lambda **kw: seen.append(shape_of(kw)) or inner(**kw)
        return runner

    record(build_runner(w, WorkloadVariant(max_batch=8), module, "cpu"))(reqs)
    record(build_runner(w, WorkloadVariant(max_batch=4, bucket_sizes=(4,)), module, "cpu"))(reqs)
    assert seen == [(("series", (11, 336)),), (("series", (12, 336)),)]  # the bucket's copy of the last, then 12
    fno = get_workload("fno")
    assert fno.pad is None
    with pytest.raises(ValueError, match="a same_size batch has none"):
        dataclasses.replace(fno, pad=w.pad)


def test_padding_below_the_batch_is_refused():
    w = get_workload("patchtst")
    batch = w.collate([r.tensors for r in w.make_inputs([3, 4], 1)])
    with pytest.raises(ValueError, match="cannot pad a batch of 7 series to 6"):
        w.pad(batch, 6)
    assert w.pad(batch, 7) is batch
    pytest.importorskip("e3nn")
    p = get_workload("protein_e3nn")
    graph = p.collate([r.tensors for r in p.make_inputs([20, 12], 1)])
    n, e = graph["pos"].shape[0], graph["edge_index"].shape[1]
    with pytest.raises(ValueError, match=f"cannot pad a batch of {n} residues to {n - 1}"):
        p.pad(graph, nodes=n - 1)
    with pytest.raises(ValueError, match=f"cannot pad a batch of {e} edges to {e - 1}"):
        p.pad(graph, edges=e - 1)
    with pytest.raises(ValueError, match="needs two dummy residues"):
        p.pad(graph, nodes=n + 1, edges=e + 1)



def test_the_gates_reference_runs_the_variants_padded_batches(modules):
    """checks/workload_gate.py's reference keeps the variant's buckets, so it runs the same padded batches and a
    graphed variant stays bit-exact against it."""
    from checks.workload_gate import BIT_EXACT, gate_workload, reference_for

    w, module = setup(modules, "protein_e3nn")
    variant = WorkloadVariant(max_batch=4, bucket_sizes=(2, 4))
    reqs = w.make_inputs([32, 50, 7], 4)
    shapes = []
    for v in (variant, reference_for(variant)):
        runner = build_runner(w, v, module, "cpu")
        inner, seen = runner.forward, []
        runner.forward = lambda inner=inner, seen=seen, **kw: seen.append(shape_of(kw)) or inner(**kw)
        runner(reqs)
        shapes.append(seen)
    bucket = [r.tensors for r in reqs] + [reqs[-1].tensors]  # 3 requests in the bucket of 4
    assert shapes[0] == shapes[1] == [shape_of(w.pad(w.collate(bucket)))]
    r = gate_workload(w, variant, module, "cpu", batch_sizes=(3,), rounds=1)
    assert r.passed and r.mode == BIT_EXACT and r.max_abs == 0.0, r.line()
