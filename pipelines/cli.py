"""The ``polyinf`` command line.

Every subcommand turns bad input into one clear line on stderr and a non-zero exit.
Heavy imports (torch, transformers, dagster) happen inside the subcommands.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _seconds(text: str, allow_zero: bool = False) -> float:
    """argparse type: a finite number > 0 (>= 0 with ``allow_zero``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 if allow_zero else v > 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {text}")
    return v


def _scale(text: str) -> float:
    """argparse type: a time scale, a finite number >= 0."""
    return _seconds(text, allow_zero=True)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="alias (smollm2), a .gguf file, a Hugging Face model folder (config.json + safetensors), "
                        "or a preset name for synthetic weights (llama-3.1-8b, qwen3-30b-a3b)")
    p.add_argument("--synthetic", action="store_true", help="random weights from the model's config (fixed seed)")
    p.add_argument("--seed", type=int, default=0, help="seed for synthetic weights")
    p.add_argument("--layers", type=_positive, default=None, help="load only the first N decoder layers")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=_positive, default=None, help="KV-cache blocks (default: fill --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=_positive, default=512, help="KV-cache memory when --num-kv-blocks is not set")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048)
    p.add_argument("--max-model-len", type=_positive, default=None)
    p.add_argument("--variant", default=None,
                   help="a VariantSpec JSON file (see 'polyinf variants show'); its knobs override the flags above")


def _engine_config(args: argparse.Namespace):
    from engine import EngineConfig, SchedulerConfig, resolve
    from engine.variant import VariantSpec

    return EngineConfig(
        source=resolve(args.model, synthetic=args.synthetic, seed=args.seed),
        device=args.device,
        dtype=args.dtype,
        layers=args.layers,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_mb * 1024**2,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        variant=VariantSpec.load(args.variant) if args.variant else None,
    )


def _generate(rank: int, config, prompt: str, params, chat: bool) -> dict:
    """One engine (one rank of a tensor-parallel group) generating for one prompt."""
    import dataclasses

    from engine import LLMEngine
    from engine.parallel import rank_device

    engine = LLMEngine(dataclasses.replace(config, device=rank_device(config.device, rank)))
    ids = prompt
    if engine.tokenizer is None:
        try:
            ids = [int(t) for t in prompt.replace(",", " ").split()] if prompt.strip() else []
        except ValueError:
            from engine.errors import RequestError

            raise RequestError("this model has no tokenizer: give --prompt as token ids, e.g. \"1 5 9\"") from None
    t0 = time.perf_counter()
    out = engine.generate([ids], params, chat=chat)[0]
    secs = time.perf_counter() - t0
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "variant_id": engine.variant.variant_id, "seconds": round(secs, 4),
            "tokens_per_second": round(len(out.token_ids) / secs if secs > 0 else 0.0, 2),
            "load_seconds": round(engine.load_seconds, 2)}


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import SamplingParams
    from engine.parallel import run_ranks

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.sample_seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    config = _engine_config(args)
    tp = config.initial_variant().tp
    if tp > 1:  # one process per rank (GPU i for rank i, or gloo on CPU); rank 0 reports
        from engine.loader import load_config
        from engine.parallel import shard_config

        shard_config(load_config(config.source), tp)  # an indivisible model fails here, before any process starts
        out = run_ranks(tp, config.device, _generate, config, args.prompt, params, args.chat)
    else:
        out = _generate(0, config, args.prompt, params, args.chat)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "load_seconds"}))
    else:
        print(out["text"])
        print(f"[{len(out['token_ids'])} tokens in {out['seconds']:.2f} s: {out['tokens_per_second']:.1f} tokens/s; "
              f"model loaded in {out['load_seconds']:.1f} s" + (f"; tensor parallel over {tp} ranks" if tp > 1 else "")
              + "]", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from checks.gates import gate_variant
    from checks.prompts import shipped_prompts, trace_prompts
    from engine import LLMEngine
    from engine.variant import VariantSpec

    if not args.variant:
        print("polyinf: error: check needs --variant FILE", file=sys.stderr)
        return 2
    spec = VariantSpec.load(args.variant)
    config = _engine_config(args)
    import dataclasses

    base = LLMEngine(dataclasses.replace(config, variant=None, num_kv_blocks=8))
    prompts = shipped_prompts(base)
    if args.trace:
        from ops.traces import TraceError, load_trace

        try:
            records = load_trace(args.trace, lenient=args.lenient)[: args.trace_prompts]
        except TraceError as e:
            print(f"polyinf: error: {e}", file=sys.stderr)
            return 2
        prompts += trace_prompts([min(r.input_tokens, args.max_input) for r in records], base.model_config.vocab_size)
    from checks.report import DEFAULT_THRESHOLDS, QualityThresholds

    t = DEFAULT_THRESHOLDS[config.dtype]
    thresholds = QualityThresholds(
        min_greedy_agreement=t.min_greedy_agreement if args.min_agreement is None else args.min_agreement,
        max_abs_logit_delta=t.max_abs_logit_delta if args.max_logit_delta is None else args.max_logit_delta,
        max_mean_kl=t.max_mean_kl if args.max_kl is None else args.max_kl)
    report = gate_variant(base, spec, prompts=prompts, max_tokens=args.max_tokens, exact=args.exact,
                          thresholds=thresholds)
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.verdict == "pass" else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from engine import LLMEngine
    from ops.bench import SLO, fast_tier, slow_tier

    engine = LLMEngine(_engine_config(args))
    if args.tier == "fast":
        result = fast_tier(engine, args.prefill_lengths, [(b, args.context) for b in args.decode_batches],
                           repeats=args.repeats)
    else:
        from ops.replay import synthesize_prompts
        from ops.traces import TraceError, load_trace

        if not args.trace:
            print("polyinf: error: the slow tier needs --trace", file=sys.stderr)
            return 2
        try:
            records = load_trace(args.trace, lenient=args.lenient)[: args.requests]
        except TraceError as e:
            print(f"polyinf: error: {e}", file=sys.stderr)
            return 2
        prompts = synthesize_prompts(records, engine.model_config.vocab_size, max_input=args.max_input)
        result = slow_tier(engine, records, prompts, f"{Path(args.trace).name}[:{len(records)}]",
                           repeats=args.repeats, time_scale=args.time_scale, max_output=args.max_output,
                           slo=SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
    print(json.dumps(result.to_json(), indent=2))
    return 0


def run_optimize(model: str, trace: str, requests: int, max_input: int, max_output: int, time_scale: float,
                 candidates: int, device: str = "cpu", dtype: str = "float32", fast_layers: int = 4,
                 artifacts: str = ".polyinf/artifacts", endpoint_url: str = "", admin_token: str = "",
                 llm_base_url: str = "", llm_model: str = "polyinf"):
    """Materializes the whole graph in-process; returns the Dagster result."""
    import dagster as dg

    from assets import pipeline
    from pipelines.resources import ArtifactStore, Endpoint, EngineRunner, TrafficSource, VariantSource, env_secret

    if admin_token:
        os.environ["POLYINF_ADMIN_TOKEN"] = admin_token  # resources read it through dg.EnvVar
    resources = {
        "runner": EngineRunner(model=model, device=device, dtype=dtype, fast_layers=fast_layers),
        "traffic": TrafficSource(trace=trace, max_requests=requests, max_input=max_input, max_output=max_output,
                                 time_scale=time_scale),
        "source": VariantSource(candidates=candidates, board=str(Path(artifacts) / "board.sqlite"),
                                llm_base_url=llm_base_url, llm_model=llm_model,
                                llm_api_key=env_secret("OPENAI_API_KEY")),
        "artifacts": ArtifactStore(root=artifacts),
        "endpoint": Endpoint(url=endpoint_url, admin_token=env_secret("POLYINF_ADMIN_TOKEN")),
    }
    definitions = [*dg.load_assets_from_modules([pipeline]), *dg.load_asset_checks_from_modules([pipeline])]
    instance = dg.DagsterInstance.ephemeral()
    key = pipeline.deployment_key(model, device, endpoint_url)
    instance.add_dynamic_partitions(pipeline.DEPLOYMENTS.name, [key])
    return dg.materialize(definitions, resources=resources, raise_on_error=False, instance=instance,
                          partition_key=key)


def cmd_optimize(args: argparse.Namespace) -> int:
    from pipelines.resources import stop_embedded_servers

    t0 = time.perf_counter()
    try:
        result = run_optimize(args.model, args.trace, args.requests, args.max_input, args.max_output, args.time_scale,
                              args.candidates, args.device, args.dtype, args.fast_layers, args.artifacts,
                              args.endpoint_url, args.admin_token or "", args.llm_base_url, args.llm_model)
        if not result.success:
            failed = [e.message for e in result.all_events if e.is_failure][:3]
            print("polyinf: error: the optimization run failed: " + " | ".join(failed), file=sys.stderr)
            return 1
        build = result.output_for_node("engine_build")
        dep = result.output_for_node("deployed_endpoint")
        checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
        base, best = build.baseline_bench, build.bench
        print(f"{'':28}{'baseline (default)':>22}{'chosen ' + build.variant.variant_id:>26}")
        for label, key, scale, fmt in (("output tokens/s", "output_tok_s", 1, ".1f"),
                                       ("goodput (req/s)", "goodput", 1, ".2f"),
                                       ("TTFT p50 / p99 (ms)", ("ttft_p50", "ttft_p99"), 1e3, ".0f"),
                                       ("TPOT p50 / p99 (ms)", ("tpot_p50", "tpot_p99"), 1e3, ".1f")):
            def cell(b):
                if isinstance(key, tuple):
                    return " / ".join(format(b[k] * scale, fmt) for k in key)
                return format(b[key] * scale, fmt)
            print(f"{label:28}{cell(base):>22}{cell(best):>26}")
        print(f"spread (output tok/s)       {base['spread']:>22.2f}{best['spread']:>26.2f}")
        print(f"why: {build.reason}")
        prov = build.provenance
        print(f"board: {prov.get('board')}, search {prov.get('search')}, decision message {prov.get('decision_message')} "
              f"resting on results {prov.get('result_ids')}")
        print("gates: " + ", ".join(f"{k} {'passed' if v else 'FAILED'}" for k, v in checks.items()))
        if build.quality:
            print(f"quality: {build.quality['verdict']} (greedy agreement {build.quality['greedy_agreement']}, "
                  f"max |dlogit| {build.quality['max_abs_logit_delta']})")
        print(f"deployment: {dep.status} at {dep.endpoint}: {dep.reason}")
        print(f"[optimization run took {time.perf_counter() - t0:.0f} s]")
        return 0
    finally:
        if not args.keep_serving:
            stop_embedded_servers()


def _llm_agent(args: argparse.Namespace, board):
    import os

    from ops.agents import LLMAgent

    key = os.environ.get(args.llm_api_key_env, "") if args.llm_api_key_env else ""
    return LLMAgent(base_url=args.llm_base_url, model=args.llm_model, api_key=key or "none", board=board,
                    timeout_s=args.llm_timeout, max_tokens=args.llm_max_tokens)


def cmd_tune(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from ops.board import Board
    from ops.tune import Budget, default_agents, tune
    from ops.worker import SearchConfig

    if args.budget < 2:
        raise ConfigError("--budget must allow at least 2 experiments (the baseline on both tiers)")
    if not Path(args.trace).is_file():
        raise ConfigError(f"trace not found: {args.trace}")
    cfg = SearchConfig(model=args.model, trace=args.trace, device=args.device, dtype=args.dtype,
                       requests=args.requests, max_input=args.max_input, max_output=args.max_output,
                       time_scale=args.time_scale, fast_layers=args.fast_layers, slow_layers=args.slow_layers,
                       slow_repeats=args.repeats, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3,
                       lenient=args.lenient, num_kv_blocks=args.num_kv_blocks)
    agents = default_agents()
    board = Board(args.board)
    if args.llm_base_url:
        agents.insert(2, _llm_agent(args, board))
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if not args.quiet else (lambda m: None)
    report = tune(cfg, args.board, agents, Budget(args.budget, args.budget_seconds), slow_top=args.slow_top,
                  gate=args.gate, log=log)
    board.close()
    print(report.text())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2, default=str))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from ops.board import Board
    from ops.hardware import probe
    from ops.worker import SearchConfig, Workbench, work

    board = Board(args.board, lease_s=args.lease_s)
    try:
        cfg = SearchConfig.from_json(board.search_config(args.search))
    except KeyError as e:
        print(f"polyinf: error: {e.args[0]}", file=sys.stderr)
        return 2
    bench = Workbench(cfg, probe(cfg.device, size_mb=64))
    stats = work(board, args.search, bench, args.tier, max_experiments=args.max_experiments)
    print(json.dumps({"evaluated": stats.evaluated, "failed": stats.failed, "lost": stats.lost,
                      "result_ids": stats.result_ids, "seconds": round(stats.seconds, 2)}))
    return 0


def cmd_variants_show(args: argparse.Namespace) -> int:
    from engine.variant import REFERENCE_VARIANT, VariantSpec

    spec = VariantSpec.load(args.variant) if args.variant else REFERENCE_VARIANT
    print(json.dumps(spec.to_json(), indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine import LLMEngine
    from engine.async_engine import AsyncEngine
    from engine.capture import CaptureWriter
    from engine.metrics import EngineMetrics
    from engine.server import build_app

    engine = LLMEngine(_engine_config(args))
    capture = CaptureWriter(args.capture_dir, keep_prompt_text=args.capture_prompts) if args.capture_dir else None
    aengine = AsyncEngine(engine, EngineMetrics(), capture)
    name = args.served_model_name or args.model
    app = build_app(aengine, name, admin_token=args.admin_token)
    print(f"polyinf: serving {name!r} on http://{args.host}:{args.port} (variant {engine.variant.variant_id})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        aengine.shutdown()
        if capture is not None:
            capture.close()
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ops.traces import ImportStats, TraceError, load_trace, profile

    stats = ImportStats()
    try:
        records = load_trace(args.trace, fmt=args.format, lenient=args.lenient, stats=stats)
        prof = profile(records)
    except TraceError as e:
        print(f"polyinf: error: {e}", file=sys.stderr)
        return 2
    out = {"trace": str(args.trace), "skipped_rows": stats.skipped, **prof.to_json()}
    print(json.dumps(out, indent=2))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from ops.replay import replay_async, report_json, synthesize_prompts
    from ops.traces import TraceError, load_trace

    try:
        records = load_trace(args.trace, fmt=args.format, lenient=args.lenient)
    except TraceError as e:
        print(f"polyinf: error: {e}", file=sys.stderr)
        return 2
    records = records[: args.max_requests] if args.max_requests else records
    if not records:
        print("polyinf: error: the trace has no requests", file=sys.stderr)
        return 2
    vocab = args.vocab_size
    if vocab is None:
        try:
            from engine.loader import load_config, resolve

            vocab = load_config(resolve(args.tokenizer or args.model)).vocab_size
        except Exception:
            vocab = 32000
    prompts = synthesize_prompts(records, vocab, max_input=args.max_input, seed=args.seed)
    report = asyncio.run(replay_async(records, prompts, args.base_url, args.model, time_scale=args.time_scale,
                                      max_output=args.max_output, max_concurrency=args.max_concurrency,
                                      slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms))
    print(report.table())
    if args.json:
        Path(args.json).write_text(report_json(report))
    return 0 if report.completed else 1


def _add_search_args(p: argparse.ArgumentParser) -> None:
    """The model, trace slice and tiers a search (optimize, tune) measures."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trace", required=True, help="the traffic to tune for (Azure CSV, Mooncake JSONL, capture)")
    p.add_argument("--requests", type=_positive, default=16, help="requests from the start of the trace")
    p.add_argument("--max-input", type=_positive, default=128, help="clip prompt lengths (a CPU-sized slice)")
    p.add_argument("--max-output", type=_positive, default=16, help="clip output lengths")
    p.add_argument("--time-scale", type=_scale, default=0.02, help="compress the trace's arrival times")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fast-layers", type=_positive, default=4, help="layers of the fast tier's engine")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyinf",
        description="Polymorphic Inference: an LLM inference engine kept tuned to its traffic, model and hardware.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and print it with tokens/s")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="prompt text (token ids, space separated, for synthetic models)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=_positive, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, prompt_token_ids")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    sv.add_argument("--capture-dir", default=None, help="append every finished request as a TraceRecord here")
    sv.add_argument("--capture-prompts", action="store_true", help="also capture prompt text (off by default)")
    sv.add_argument("--admin-token", default=None,
                    help="bearer token for /admin endpoints (default: $POLYINF_ADMIN_TOKEN; none disables them)")
    sv.add_argument("--log-level", default="warning")
    sv.set_defaults(func=cmd_serve)

    pr = sub.add_parser("profile", help="print a trace's TrafficProfile as JSON")
    pr.add_argument("--trace", required=True, help="Mooncake JSONL, Azure CSV, or a capture file")
    pr.add_argument("--format", choices=["mooncake", "azure", "capture"], default=None, help="default: detected")
    pr.add_argument("--lenient", action="store_true", help="count and skip malformed rows instead of failing")
    pr.set_defaults(func=cmd_profile)

    rp = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible endpoint and report latencies")
    rp.add_argument("--trace", required=True)
    rp.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    rp.add_argument("--model", required=True, help="the served model name")
    rp.add_argument("--tokenizer", default=None, help="local model whose vocabulary prompts are drawn from")
    rp.add_argument("--vocab-size", type=_positive, default=None)
    rp.add_argument("--format", choices=["mooncake", "azure", "capture"], default=None)
    rp.add_argument("--lenient", action="store_true")
    rp.add_argument("--max-requests", type=_positive, default=None)
    rp.add_argument("--time-scale", type=_scale, default=1.0, help="multiply arrival times (0 sends all at once)")
    rp.add_argument("--max-input", type=_positive, default=None, help="clip prompt lengths")
    rp.add_argument("--max-output", type=_positive, default=None, help="clip output lengths")
    rp.add_argument("--max-concurrency", type=_positive, default=None)
    rp.add_argument("--slo-ttft-ms", type=_seconds, default=None)
    rp.add_argument("--slo-tpot-ms", type=_seconds, default=None)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--json", default=None, help="also write the report as JSON here")
    rp.set_defaults(func=cmd_replay)

    ck = sub.add_parser("check", help="run the quality and KV-cache contamination gates on a variant")
    _add_model_args(ck)
    ck.add_argument("--trace", default=None, help="add prompts shaped like this trace's requests")
    ck.add_argument("--trace-prompts", type=_positive, default=4, help="how many trace-shaped prompts")
    ck.add_argument("--max-input", type=_positive, default=256, help="clip trace-shaped prompts to this length")
    ck.add_argument("--lenient", action="store_true")
    ck.add_argument("--max-tokens", type=_positive, default=12, help="tokens generated per prompt")
    ck.add_argument("--exact", action="store_true", help="the variant claims bit-identical results")
    ck.add_argument("--min-agreement", type=float, default=None, help="override the dtype's greedy-agreement floor")
    ck.add_argument("--max-logit-delta", type=float, default=None, help="override the dtype's max |delta logit|")
    ck.add_argument("--max-kl", type=float, default=None, help="override the dtype's mean-KL ceiling")
    ck.add_argument("--json", default=None, help="also write the QualityReport here")
    ck.set_defaults(func=cmd_check)

    bn = sub.add_parser("bench", help="measure the engine (one variant) on the fast or slow tier; prints a BenchResult")
    _add_model_args(bn)
    bn.add_argument("--tier", choices=["fast", "slow"], default="slow")
    bn.add_argument("--trace", default=None, help="slow tier: the trace whose slice is replayed")
    bn.add_argument("--lenient", action="store_true")
    bn.add_argument("--requests", type=_positive, default=16, help="slow tier: requests from the start of the trace")
    bn.add_argument("--time-scale", type=_scale, default=1.0, help="slow tier: multiply arrival times")
    bn.add_argument("--max-input", type=_positive, default=None, help="slow tier: clip prompt lengths")
    bn.add_argument("--max-output", type=_positive, default=None, help="slow tier: clip output lengths")
    bn.add_argument("--slo-ttft-ms", type=_seconds, default=2000.0)
    bn.add_argument("--slo-tpot-ms", type=_seconds, default=200.0)
    bn.add_argument("--prefill-lengths", type=_positive, nargs="+", default=[128, 512], help="fast tier")
    bn.add_argument("--decode-batches", type=_positive, nargs="+", default=[1, 8, 32], help="fast tier")
    bn.add_argument("--context", type=_positive, default=256, help="fast tier: decode context length")
    bn.add_argument("--repeats", type=_positive, default=3)
    bn.set_defaults(func=cmd_bench)

    op = sub.add_parser("optimize", help="materialize the whole optimization graph in-process (embedded defaults)")
    _add_search_args(op)
    op.add_argument("--candidates", type=_positive, default=4, help="variants proposed besides the baseline")
    op.add_argument("--artifacts", default=".polyinf/artifacts")
    op.add_argument("--endpoint-url", default="", help="deploy to this server (default: start one on loopback)")
    op.add_argument("--admin-token", default=None, help="the endpoint's admin token")
    op.add_argument("--keep-serving", action="store_true", help="leave the embedded server running")
    op.add_argument("--llm-base-url", default="", help="an OpenAI-compatible server for the LLM agent (off if empty)")
    op.add_argument("--llm-model", default="polyinf", help="the model name on that server")
    op.set_defaults(func=cmd_optimize)

    tn = sub.add_parser("tune", help="search for a better variant outside Dagster: agents propose, the fast and "
                                     "slow tiers measure, the decision and its reasons are printed")
    _add_search_args(tn)
    tn.add_argument("--budget", type=_positive, default=12, help="most experiments (fast and slow tier together)")
    tn.add_argument("--budget-seconds", type=_seconds, default=900.0, help="most wall time for the search")
    tn.add_argument("--board", default=".polyinf/board.sqlite", help="the SQLite message board and queue")
    tn.add_argument("--slow-layers", type=_positive, default=None, help="layers of the slow tier's engine (default: all)")
    tn.add_argument("--slow-top", type=_positive, default=2, help="best fast-tier variants measured on the slow tier")
    tn.add_argument("--repeats", type=_positive, default=3, help="slow-tier replays per variant")
    tn.add_argument("--num-kv-blocks", type=_positive, default=512)
    tn.add_argument("--slo-ttft-ms", type=_seconds, default=2000.0)
    tn.add_argument("--slo-tpot-ms", type=_seconds, default=200.0)
    tn.add_argument("--lenient", action="store_true", help="skip malformed trace rows")
    tn.add_argument("--gate", action="store_true", help="run the quality and contamination gates on the choice")
    tn.add_argument("--llm-base-url", default="", help="an OpenAI-compatible server for the LLM agent (off if empty)")
    tn.add_argument("--llm-model", default="polyinf", help="the model name on that server")
    tn.add_argument("--llm-api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    tn.add_argument("--llm-timeout", type=_seconds, default=120.0)
    tn.add_argument("--llm-max-tokens", type=_positive, default=512)
    tn.add_argument("--json", default=None, help="also write the report as JSON here")
    tn.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    tn.set_defaults(func=cmd_tune)

    wk = sub.add_parser("worker", help="a benchmark worker: drain a search's experiment queue from the board")
    wk.add_argument("--board", required=True)
    wk.add_argument("--search", required=True, help="the search id (printed by 'polyinf tune')")
    wk.add_argument("--tier", choices=["fast", "slow"], default=None, help="only this tier's experiments")
    wk.add_argument("--max-experiments", type=_positive, default=None)
    wk.add_argument("--lease-s", type=_seconds, default=60.0, help="a claim lapses this long after the last heartbeat")
    wk.set_defaults(func=cmd_worker)

    v = sub.add_parser("variants", help="engine variants (VariantSpec JSON)")
    vsub = v.add_subparsers(dest="variants_command", required=True)
    show = vsub.add_parser("show", help="print a variant as JSON with its variant_id (default: the reference variant)")
    show.add_argument("--variant", default=None, help="a VariantSpec JSON file to validate and print")
    show.set_defaults(func=cmd_variants_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        # Triton kernels (built-in and generated) run on a CPU in Triton's interpreter, which must be chosen
        # before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from engine.errors import EngineError
    except ImportError as e:  # pragma: no cover
        print(f"polyinf: cannot import the engine: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except EngineError as e:
        print(f"polyinf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
