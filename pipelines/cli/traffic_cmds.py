"""Traffic commands: profile a trace, replay it against an endpoint."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipelines.cli.args import positive, scale, seconds


def cmd_profile(args: argparse.Namespace) -> int:
    from ops.traffic.traces import ImportStats, load_trace, profile

    stats = ImportStats()
    records = load_trace(args.trace, fmt=args.format, lenient=args.lenient, stats=stats)
    prof = profile(records)
    out = {"trace": str(args.trace), "skipped_rows": stats.skipped, **prof.to_json()}
    print(json.dumps(out, indent=2))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from engine.errors import ConfigError
    from ops.traffic.replay import parse_goodput, replay_async, report_json, synthesize_prompts, vllm_result
    from ops.traffic.traces import load_trace

    try:
        goodput = parse_goodput(args.goodput or [])
        metrics = tuple(m for m in args.percentile_metrics.split(",") if m)
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if set(metrics) - {"ttft", "tpot", "itl", "e2el"} or any(not 0 < p < 100 for p in percentiles):
        raise ConfigError("--percentile-metrics takes ttft, tpot, itl, e2el; --metric-percentiles numbers in (0, 100)")
    slo_ttft = goodput.get("ttft", args.slo_ttft_ms)
    slo_tpot = goodput.get("tpot", args.slo_tpot_ms)
    records = load_trace(args.trace, fmt=args.format, lenient=args.lenient)
    records = records[: args.max_requests] if args.max_requests else records
    if not records:
        raise ConfigError("the trace has no requests")
    vocab, tok = args.vocab_size, None
    if vocab is None:
        try:
            from engine.loader.model_source import load_config, resolve

            source = resolve(args.tokenizer or args.model)
            vocab = load_config(source).vocab_size
        except Exception:
            source, vocab = None, 32000
        if args.tokenizer and source is not None and source.tokenizer_path and source.kind != "synthetic":
            from engine.loader.tokenizer import Tokenizer

            tok = Tokenizer(source.tokenizer_path)  # prompts of real text, of the recorded lengths
    from ops.traffic.corpus import corpus_for

    prompts = synthesize_prompts(records, vocab, max_input=args.max_input, seed=args.seed, tokenizer=tok,
                                 corpus=corpus_for(args.trace) if tok else None)
    report = asyncio.run(replay_async(records, prompts, args.base_url, args.model, time_scale=args.time_scale,
                                      max_output=args.max_output, max_concurrency=args.max_concurrency,
                                      slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot, slo_e2el_ms=goodput.get("e2el")))
    print(report.table())
    if args.json:
        Path(args.json).write_text(report_json(report))
    if args.save_result:
        res = vllm_result(report, args.model, metrics=metrics, percentiles=percentiles,
                          max_concurrency=args.max_concurrency,
                          goodput=goodput or ({"ttft": slo_ttft, "tpot": slo_tpot} if slo_ttft or slo_tpot else None))
        Path(args.save_result).write_text(json.dumps(res, indent=2))
    return 0 if report.completed else 1


def add_parsers(sub) -> None:
    pr = sub.add_parser("profile", help="print a trace's TrafficProfile as JSON")
    pr.add_argument("--trace", required=True, help="Mooncake JSONL, Azure CSV, or a capture file")
    pr.add_argument("--format", choices=["mooncake", "azure", "capture"], default=None, help="default: detected")
    pr.add_argument("--lenient", action="store_true", help="count and skip malformed rows instead of failing")
    pr.set_defaults(func=cmd_profile)

    rp = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible endpoint and report latencies")
    rp.add_argument("--trace", required=True)
    rp.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    rp.add_argument("--model", required=True, help="the served model name")
    rp.add_argument("--tokenizer", default=None, help="local model whose tokenizer writes the prompts: real text "
                                                      "(code or prose) of the recorded lengths; without it, random "
                                                      "token ids")
    rp.add_argument("--vocab-size", type=positive, default=None)
    rp.add_argument("--format", choices=["mooncake", "azure", "capture"], default=None)
    rp.add_argument("--lenient", action="store_true")
    rp.add_argument("--max-requests", type=positive, default=None)
    rp.add_argument("--time-scale", type=scale, default=1.0, help="multiply arrival times (0 sends all at once)")
    rp.add_argument("--max-input", type=positive, default=None, help="clip prompt lengths")
    rp.add_argument("--max-output", type=positive, default=None, help="clip output lengths")
    rp.add_argument("--max-concurrency", type=positive, default=None)
    rp.add_argument("--slo-ttft-ms", type=seconds, default=None)
    rp.add_argument("--slo-tpot-ms", type=seconds, default=None)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--json", default=None, help="also write the report as JSON here")
    rp.add_argument("--save-result", default=None,
                    help="also write the result in `vllm bench serve --save-result`'s keys and units here")
    rp.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="vLLM's goodput SLOs, e.g. ttft:2000 tpot:200 (keys ttft, tpot, e2el; milliseconds)")
    rp.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="vLLM's: the metrics given percentiles")
    rp.add_argument("--metric-percentiles", default="99", help="vLLM's: the percentiles, comma-separated")
    rp.set_defaults(func=cmd_replay)
