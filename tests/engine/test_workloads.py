"""The non-LLM workloads: each model's forward against an independent reference on fresh random inputs, batch
invariance, the batch policy, the variants and their runner (hot swap keeps the module), and clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from engine.workloads import (WORKLOADS, BatchPolicy, WorkloadVariant, build_runner, get_workload, static_best)
from engine.workloads.fno import SpectralConv2d
from engine.workloads.variants import refusal


@pytest.fixture(scope="module")
def modules():
    return {}


def module_of(modules: dict, name: str) -> torch.nn.Module:
    if name not in modules:
        modules[name] = get_workload(name).build()
    return modules[name]


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


# ---- FNO ---------------------------------------------------------------------------------------------------
def test_spectral_conv_matches_a_direct_dft_in_float64():
    """rfft2 -> complex weights on the kept modes -> irfft2, against the sums written out: the forward DFT of each
    kept mode, the weight product, and the real inverse (the half spectrum's non-zero columns counted twice)."""
    torch.manual_seed(fresh_seed())
    b, ci, co, h, w, m = 2, 3, 4, 12, 14, 4
    conv = SpectralConv2d(ci, co, m)
    x = torch.randn(b, ci, h, w)
    got = conv(x).double()
    xs, ys = torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64)
    rows = list(range(m)) + list(range(h - m, h))  # kept k1: the first m and the last m
    out = torch.zeros(b, co, h, w, dtype=torch.float64)
    for r, k1 in enumerate(rows):
        weight = (conv.weight1 if r < m else conv.weight2)[:, :, k1 if r < m else k1 - (h - m)].to(torch.complex128)
        for k2 in range(m):
            phase = 2 * math.pi * (k1 * xs.view(h, 1) / h + k2 * ys.view(1, w) / w)  # [h, w]
            basis = torch.polar(torch.ones_like(phase), -phase)
            coef = (x.double().to(torch.complex128) * basis).sum((-2, -1))  # [b, ci]: the DFT at (k1, k2)
            y = torch.einsum("bi,io->bo", coef, weight[:, :, k2])
            twice = 1 if k2 == 0 else 2
            out += twice * (y.view(b, co, 1, 1) * basis.conj()).real / (h * w)
    assert torch.allclose(got, out, atol=1e-5, rtol=1e-4), (got - out).abs().max()


def test_fno_rejects_bad_grids(modules):
    fno = module_of(modules, "fno")
    with pytest.raises(ValueError, match=r"\[batch, 10, H, W\]"):
        fno(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="at least 24"):
        fno(torch.randn(1, 10, 16, 16))


# ---- weather GNN ---------------------------------------------------------------------------------------------
def _interaction_reference(block, x_src, x_dst, edge_index, e):
    """An interaction block in plain torch: gather, message MLP, index_add at the destination, node update."""
    src, dst = edge_index
    msg = block.edge_mlp(torch.cat([x_dst[:, dst], x_src[:, src], e.expand(x_dst.shape[0], -1, -1)], -1))
    summed = torch.zeros(*x_dst.shape[:-1], msg.shape[-1], dtype=msg.dtype).index_add_(1, dst, msg)
    return x_dst + block.node_mlp(torch.cat([x_dst, summed], -1))


def test_weather_gnn_matches_a_scatter_add_reference_in_float64(modules):
    import copy

    model = copy.deepcopy(module_of(modules, "weather_gnn")).double()
    w = get_workload("weather_gnn")
    state = torch.cat([r.tensors["state"] for r in w.make_inputs([12, 12], fresh_seed())])
    got = module_of(modules, "weather_gnn")(state).double()
    s = state.double()
    b, n_lat = s.shape[:2]
    grid, g2m, m2g, g2m_geo, m2g_geo = (t.double() if t.is_floating_point() else t for t in model.graphs(n_lat))
    x = s.reshape(b, -1, model.n_vars)
    cos = (1 - grid[:, 2] ** 2).sqrt()
    static = torch.stack([grid[:, 2], grid[:, 0] / cos, grid[:, 1] / cos], -1)
    hg = model.grid_embed(torch.cat([x, static.expand(b, -1, -1)], -1))
    hm = model.mesh_embed(model.mesh_pos).expand(b, -1, -1)
    d = model.mesh_pos[model.mesh_edges[1]] - model.mesh_pos[model.mesh_edges[0]]
    e_mesh = model.mesh_edge(torch.cat([d, d.norm(dim=-1, keepdim=True)], -1))
    hm = _interaction_reference(model.encoder, hg, hm, g2m, model.g2m_edge(g2m_geo))
    for layer in model.processor:
        hm = _interaction_reference(layer, hm, hm, model.mesh_edges, e_mesh)
    hg = _interaction_reference(model.decoder, hm, hg, m2g, model.m2g_edge(m2g_geo))
    want = s + model.head(hg).reshape(s.shape)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_icosahedral_mesh_has_the_counts_of_a_refined_icosahedron():
    from engine.workloads.weather_gnn import icosphere

    for level, nodes in ((0, 12), (1, 42), (3, 642)):
        v, e = icosphere(level)
        assert v.shape == (nodes, 3) and e.shape[1] == 3 * (nodes - 2)  # Euler: E = 3V - 6
        assert torch.allclose(v.norm(dim=1), torch.ones(nodes))


# ---- protein e3nn ---------------------------------------------------------------------------------------------
def test_protein_model_is_rotation_equivariant_and_translation_invariant(modules):
    from e3nn import o3

    from engine.workloads.protein_e3nn import OUTPUT

    model = module_of(modules, "protein_e3nn")
    req = get_workload("protein_e3nn").make_inputs([48], fresh_seed())[0].tensors
    out = model(**req)
    rot = o3.rand_matrix()
    turned = req["pos"] @ rot.t() + torch.randn(3)
    # the same edges: a rotation keeps every distance (recomputed, one could round across the cutoff)
    out_turned = model(turned, req["types"], req["edge_index"])
    want = out @ o3.Irreps(OUTPUT).D_from_matrix(rot).t()
    # float32 through the spherical harmonics and tensor products: errors of 1e-4 of the output's scale happen on
    # some draws; a broken equivariance is off by the output's own magnitude
    scale = want.abs().max()
    assert (out_turned - want).abs().max() <= 1e-3 * scale, ((out_turned - want).abs().max(), scale)
    assert out[:, 1:].abs().max() > 1e-3  # the vector output is not trivially zero


def test_protein_batch_is_a_disjoint_graph(modules):
    w = get_workload("protein_e3nn")
    reqs = w.make_inputs([32, 64, 40], fresh_seed())
    batch = w.collate([r.tensors for r in reqs])
    assert batch["edge_index"].max() < 136 and batch["pos"].shape == (136, 3)
    out = w.split(module_of(modules, "protein_e3nn")(**batch), [r.tensors for r in reqs])
    for r, o in zip(reqs, out):
        assert torch.equal(o, module_of(modules, "protein_e3nn")(**r.tensors))


# ---- PatchTST ------------------------------------------------------------------------------------------------
def test_patchtst_forecast_does_not_depend_on_the_batch(modules):
    """A series' forecast is the same bits alone and among other series (channel independence, and the head's
    rows padded so the BLAS takes one kernel)."""
    model = module_of(modules, "patchtst")
    w = get_workload("patchtst")
    reqs = w.make_inputs([1, 3, 7, 21], fresh_seed())
    alone = [model(**r.tensors) for r in reqs]
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0]):
        together = model(torch.cat([reqs[i].tensors["series"] for i in order]))
        for part, i in zip(together.split([reqs[i].size for i in order]), order):
            assert torch.equal(part, alone[i])


def test_patchtst_patches_are_the_strided_windows_of_the_padded_series():
    from engine.workloads.patchtst import LOOKBACK, PATCH, STRIDE, PatchTST

    model = PatchTST()
    x = torch.randn(2, LOOKBACK)
    padded = torch.cat([x, x[:, -1:].repeat(1, STRIDE)], 1)
    patches = padded.unfold(1, PATCH, STRIDE)
    assert patches.shape[1] == model.n_patches == 42
    for p in (0, 17, 41):
        assert torch.equal(patches[:, p], padded[:, p * STRIDE:p * STRIDE + PATCH])
    with pytest.raises(ValueError, match=r"\[channels, 336\]"):
        model(torch.randn(3, 100))


# ---- the workload, its policy, variants and runner --------------------------------------------------------------
def test_unknown_workload_and_bad_sizes_say_what_is_known():
    with pytest.raises(ValueError, match="unknown workload 'resnet'; known: fno, weather_gnn"):
        get_workload("resnet")
    with pytest.raises(ValueError, match=r"integers in \[24, 512\]"):
        get_workload("fno").make_inputs([8], seed=0)
    with pytest.raises(ValueError, match="one resolution only"):
        w = get_workload("fno")
        w.collate([r.tensors for r in w.make_inputs([32, 48], seed=0)])


def test_make_inputs_is_deterministic_and_follows_the_sizes():
    for name, w in WORKLOADS.items():
        a, b = w.make_inputs(list(w.size_levels[:2]), seed=3), w.make_inputs(list(w.size_levels[:2]), seed=3)
        assert [r.size for r in a] == list(w.size_levels[:2]), name
        assert all(torch.equal(x.tensors[k], y.tensors[k]) for x, y in zip(a, b) for k in x.tensors), name


def test_batch_policy_groups_equal_sizes_or_concatenates():
    assert BatchPolicy(2, "same_size").plan([32, 64, 32, 32, 64]) == [[0, 2], [3], [1, 4]]
    assert BatchPolicy(2, "concat").plan([5, 1, 9]) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="grouping"):
        BatchPolicy(2, "pad")


def test_variant_id_is_content_and_fields_are_checked():
    a, b = WorkloadVariant(name="x", max_batch=4), WorkloadVariant(name="y", max_batch=4)
    assert a.variant_id == b.variant_id != WorkloadVariant(max_batch=8).variant_id
    assert WorkloadVariant(bucket_sizes=(8, 2, 2)).bucket_sizes == (2, 8)
    assert WorkloadVariant(matmul_precision="bf16").needs_tolerance and not WorkloadVariant().needs_tolerance
    assert WorkloadVariant(compile_mode="default").changed_scopes(WorkloadVariant(max_batch=2)) == {"forward",
                                                                                                   "scheduler"}
    for bad in (dict(compile_mode="fast"), dict(matmul_precision="fp8"), dict(max_batch=0),
                dict(bucket_sizes=(0,)), dict(max_batch=16, bucket_sizes=(4, 8))):
        with pytest.raises(ValueError):
            WorkloadVariant(**bad)


def test_cpu_refuses_gpu_only_variants_clearly(modules):
    fno, gnn = get_workload("fno"), get_workload("weather_gnn")
    assert "CUDA" in refusal(fno, WorkloadVariant(cuda_graphs=True), "cpu")
    assert "tensor-core" in refusal(fno, WorkloadVariant(matmul_precision="tf32"), "cpu")
    assert "not images" in refusal(gnn, WorkloadVariant(channels_last=True), "cpu")
    assert refusal(fno, WorkloadVariant(cuda_graphs=True), "cuda") is None
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        build_runner(fno, WorkloadVariant(cuda_graphs=True), module_of(modules, "fno"), "cpu")


def test_runner_buckets_and_batches_keep_every_output_and_a_swap_keeps_the_module(modules):
    w = get_workload("patchtst")
    module = module_of(modules, "patchtst")
    reqs = w.make_inputs([3, 1, 7, 12, 1], fresh_seed())
    reference = build_runner(w, WorkloadVariant(max_batch=1), module, "cpu")(reqs)
    runner = build_runner(w, WorkloadVariant(max_batch=4, bucket_sizes=(2, 4)), module, "cpu")
    assert runner.batch_cap == 4
    assert all(torch.equal(a, b) for a, b in zip(runner(reqs), reference))
    params = [p.data_ptr() for p in module.parameters()]
    runner.install(WorkloadVariant(max_batch=8))
    assert runner.module is module and [p.data_ptr() for p in module.parameters()] == params
    assert all(torch.equal(a, b) for a, b in zip(runner(reqs), reference))
    with pytest.raises(ValueError, match="cannot swap"):
        runner.install(WorkloadVariant(cuda_graphs=True))
    assert runner.variant == WorkloadVariant(max_batch=8)
    with pytest.raises(ValueError, match="empty batch"):
        runner([])


def test_same_size_batches_are_bit_exact_against_one_at_a_time(modules):
    w = get_workload("fno")
    module = module_of(modules, "fno")
    reqs = w.make_inputs([32, 48, 32, 32, 48], fresh_seed())
    one = build_runner(w, WorkloadVariant(max_batch=1), module, "cpu")(reqs)
    many = build_runner(w, WorkloadVariant(max_batch=8), module, "cpu")(reqs)
    assert [o.shape[-1] for o in many] == [32, 48, 32, 32, 48]
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def test_static_best_is_compiled_on_a_gpu_and_eager_on_a_cpu():
    w = get_workload("fno")
    assert static_best(w, "cuda").compile_mode == "default"
    cpu = static_best(w, "cpu", max_batch=4)
    assert cpu.compile_mode is None and cpu.max_batch == 4 and cpu.matmul_precision == "highest"
    assert not cpu.channels_last and not cpu.cuda_graphs and cpu.bucket_sizes == ()


# ---- GPU readiness, checked on the CPU ---------------------------------------------------------------------------
def test_a_compiled_runner_raises_the_recompile_limit_and_shares_one_wrapper(modules, monkeypatch):
    """Every variant and shape of one module compiles into one code object's cache: past dynamo's default limit (8)
    it would run eagerly in silence. Building a compiled runner raises the limit (nothing compiles until a call)."""
    import torch._dynamo.config as config

    from engine.workloads.variants import RECOMPILE_LIMIT, compile_available, release_compiled

    if not compile_available("cpu"):
        pytest.skip("no C++ compiler: a compiled variant is refused on this CPU")
    monkeypatch.setattr(config, "recompile_limit", 8)
    w, module = get_workload("patchtst"), module_of(modules, "patchtst")
    a = build_runner(w, WorkloadVariant(compile_mode="default", max_batch=4), module, "cpu")
    assert config.recompile_limit >= RECOMPILE_LIMIT and config.accumulated_recompile_limit >= RECOMPILE_LIMIT
    if hasattr(config, "cache_size_limit"):  # the older name
        assert config.cache_size_limit >= RECOMPILE_LIMIT
    b = build_runner(w, WorkloadVariant(compile_mode="default", max_batch=8, bucket_sizes=(4, 8)), module, "cpu")
    assert a.forward is b.forward  # one wrapper per module and mode: shapes compiled once serve every runner
    other = build_runner(w, WorkloadVariant(compile_mode="max-autotune-no-cudagraphs"), module, "cpu")
    assert other.forward is not a.forward
    release_compiled(module)
    assert build_runner(w, WorkloadVariant(compile_mode="default"), module, "cpu").forward is not a.forward
    release_compiled(module)


def test_eager_cuda_graphs_are_allowed_on_a_gpu_and_graphs_inside_graphs_are_not():
    fno = get_workload("fno")
    for v in (WorkloadVariant(cuda_graphs=True, max_batch=1),
              WorkloadVariant(cuda_graphs=True, max_batch=16, bucket_sizes=(1, 2, 4, 8, 16))):
        assert v.compile_mode is None and refusal(fno, v, "cuda") is None and "CUDA" in refusal(fno, v, "cpu")
    both = WorkloadVariant(compile_mode="reduce-overhead", cuda_graphs=True)
    assert "inside another" in refusal(fno, both, "cuda")


def test_graphs_past_their_cap_run_uncaptured_in_the_variants_arithmetic():
    """_Graphed keeps at most max_graphs captures; a further shape runs the function as is (under its context), so
    a workload whose shapes follow its data cannot fill the GPU with graphs. With a cap of 0 it runs on a CPU."""
    from engine.workloads.variants import _Graphed

    entered = []

    class Context:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    graphed = _Graphed(lambda x: x * 2, Context, max_graphs=0)
    assert torch.equal(graphed(x=torch.ones(3)), torch.full((3,), 2.0))
    assert graphed.uncaptured == 1 and entered and not graphed.graphs


def test_deterministic_variant_runs_with_torchs_deterministic_algorithms_and_restores_them():
    from engine.workloads.variants import WorkloadVariant, forward_context

    det, plain = WorkloadVariant(deterministic=True), WorkloadVariant()
    assert det.variant_id != plain.variant_id and "deterministic" in det.describe()
    assert det.changed_scopes(plain) == {"forward"}
    before = torch.are_deterministic_algorithms_enabled()
    with forward_context(det, "cpu"):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    with forward_context(plain, "cpu"):
        assert torch.are_deterministic_algorithms_enabled() == before


# ---- hot ops as Triton kernels (TRITON_INTERPRET=1 on the CPU, tests/conftest.py) ------------------------------------
def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


def test_each_models_triton_hot_ops_agree_with_its_torch_path():
    """Small forms of the FNO and the weather network, and the protein network through a runner of the variant:
    the Triton spectral multiply and segment sum give the torch path's outputs within 1e-4 of their scale."""
    from engine.workloads.fno import FNO2d
    from engine.workloads.hot_ops import hot_ops
    from engine.workloads.weather_gnn import WeatherGNN

    torch.manual_seed(fresh_seed())
    small = [(FNO2d(width=8, modes=4, layers=2), torch.randn(2, 10, 12, 12)),
             (WeatherGNN(hidden=16, mesh_level=1, processor_layers=1), torch.randn(2, 4, 8, 8))]
    with torch.inference_mode():
        for model, x in small:
            model.eval()
            want = model(x)
            with hot_ops("triton"):
                _close(model(x), want)
    w = get_workload("protein_e3nn")
    module, reqs = w.build(), w.make_inputs([12, 20], fresh_seed())
    want = build_runner(w, WorkloadVariant(max_batch=2), module, "cpu")(reqs)
    got = build_runner(w, WorkloadVariant(max_batch=2, hot_ops="triton"), module, "cpu")(reqs)
    for g, t in zip(got, want):
        _close(g, t)


def test_scatter_sum_on_triton_follows_any_edge_axis_and_the_torch_path_is_index_add():
    from engine.workloads.hot_ops import active, hot_ops, scatter_sum, spectral_mul

    torch.manual_seed(fresh_seed())
    dst = torch.tensor([3, 0, 3, 1, 3])
    for msg, dim in ((torch.randn(5), 0), (torch.randn(2, 5, 4), 1), (torch.randn(2, 5, 4), -2),
                     (torch.randn(4, 5), 1), (torch.randn(3, 2, 5, 6), 2)):
        want = torch.zeros(*msg.shape[:dim % msg.dim()], 6, *msg.shape[dim % msg.dim() + 1:]).index_add_(dim, dst, msg)
        assert torch.equal(scatter_sum(msg, dst, 6, dim), want)
        with hot_ops("triton"):
            assert active() == "triton"
            assert torch.allclose(scatter_sum(msg, dst, 6, dim), want, rtol=1e-6, atol=1e-6)
    assert active() == "torch"
    a, w = torch.randn(1, 3, 2, 2, dtype=torch.cfloat), torch.randn(3, 2, 2, 2, dtype=torch.cfloat)
    with hot_ops("triton"), pytest.raises(ValueError, match="complex64"):
        spectral_mul(a.to(torch.complex128), w.to(torch.complex128))
    with pytest.raises(ValueError, match="hot_ops must be one of"):
        with hot_ops("cuda"):
            pass


def test_hot_ops_field_is_checked_described_and_entered_by_the_forward_context():
    import dataclasses
    import hashlib
    import json

    from engine.workloads.hot_ops import active
    from engine.workloads.variants import forward_context

    tri = WorkloadVariant(hot_ops="triton")
    assert "triton hot ops" in tri.describe() and not tri.needs_tolerance  # judged bit-exact by default
    assert tri.changed_scopes(WorkloadVariant()) == {"forward"} and tri.variant_id != WorkloadVariant().variant_id
    # a field added later counts towards the id only when set: ids recorded before it stay valid
    plain = WorkloadVariant(max_batch=4)
    body = {f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)
            if f.metadata.get("scope") and f.name != "hot_ops"}
    assert plain.variant_id == hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()[:16]
    with pytest.raises(ValueError, match="hot_ops must be one of"):
        WorkloadVariant(hot_ops="cuda")
    with forward_context(tri, "cpu"):
        assert active() == "triton"
    assert active() == "torch"


def test_triton_hot_ops_are_refused_without_a_hot_op_a_gpu_or_the_interpreter(monkeypatch):
    tri = WorkloadVariant(hot_ops="triton")
    assert set(get_workload("fno").hot_ops) == {"spectral_mul"}
    assert {w.name for w in WORKLOADS.values() if w.hot_ops} == {"fno", "weather_gnn", "protein_e3nn"}
    assert "has none" in refusal(get_workload("patchtst"), tri, "cuda")
    assert "eager" in refusal(get_workload("fno"), WorkloadVariant(hot_ops="triton", compile_mode="default"), "cuda")
    for name in ("fno", "weather_gnn", "protein_e3nn"):
        assert refusal(get_workload(name), tri, "cuda") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert refusal(get_workload("fno"), tri, "cpu") is None
    monkeypatch.delenv("TRITON_INTERPRET")
    why = refusal(get_workload("fno"), tri, "cpu")
    assert "CUDA device" in why and "TRITON_INTERPRET=1" in why
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        build_runner(get_workload("weather_gnn"), tri, torch.nn.Identity(), "cpu")


def test_deterministic_cublas_sets_the_workspace_unless_set(monkeypatch):
    from engine.workloads.variants import CUBLAS_WORKSPACE, deterministic_cublas

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    deterministic_cublas()
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    deterministic_cublas()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # a user's own setting stays
