"""Tuning commands: optimize (the whole Dagster graph in-process), tune (a search without Dagster), worker."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipelines.cli.args import add_search_args, positive, seconds


def cmd_optimize(args: argparse.Namespace) -> int:
    from assets.resources import stop_embedded_servers
    from pipelines.wiring import dagster_home_for, run_optimize

    t0 = time.perf_counter()
    try:
        result = run_optimize(args.model, args.trace, args.requests, args.max_input, args.max_output, args.time_scale,
                              args.candidates, args.device, args.dtype, args.fast_layers, args.artifacts,
                              args.endpoint_url, args.admin_token or "", args.llm_base_url, args.llm_model,
                              log_level="DEBUG" if args.verbose else "INFO", dagster_home=args.dagster_home,
                              speculation=args.speculation, precision=args.precision,
                              judge_seconds=args.judge_seconds or 0.0, judge_top=args.judge_top or 0,
                              allow_latency_trade=args.allow_latency_trade)
        if not result.success:
            failed = [e.message for e in result.all_events if e.is_failure][:3]
            print("polyinf: error: the optimization run failed: " + " | ".join(failed), file=sys.stderr)
            return 1
        print_optimize_report(result)
        print(f"[optimization run took {time.perf_counter() - t0:.0f} s; recorded in the Dagster instance at "
              f"{dagster_home_for(args.artifacts, args.dagster_home)}]")
        return 0
    finally:
        if not args.keep_serving:
            stop_embedded_servers()


def print_optimize_report(result) -> None:
    """Every measured variant against static-best, the SLO, the judgement (each capacity with its interval and
    every probe, the comparison, the out-of-sample check), the decision and why, the gates, the deployment and
    its live verification, and where the board, the build and the plots are, from a run's outputs."""
    from ops.judge.rule import Judgement
    from ops.search.optimize import decision_table

    build = result.output_for_node("engine_build")
    dep = result.output_for_node("deployed_endpoint")
    fast, slow = result.output_for_node("fast_bench_results"), result.output_for_node("slow_bench_results")
    checks = {e.asset_check_key.name: e for e in result.get_asset_check_evaluations()}
    static_best = slow[0][0]
    judged = Judgement.from_json(build.judgement)
    kept = build.variant.variant_id == static_best.variant_id
    gate = checks.get("engine_build_gates")
    verdict = gate.metadata.get("verdict").value if gate and gate.metadata.get("verdict") else None
    print(f"SLO: {build.provenance.get('slo', '')} ({build.provenance.get('slo_source', 'given')})")
    print(decision_table(static_best, list(fast) + list(slow), build.variant.variant_id, verdict, judged))
    print()
    for line in judged.lines():
        print(line)
    print()
    print(judged.headline())
    print(f"decision: {build.reason}")
    if kept:
        held = judged.confirmation is None or judged.confirmation.holds
        print(f"kept static-best, nothing deployed ({judged.verdict}"
              + ("" if held else ": better on the search's windows, did not hold on held-out traffic") + ")")
    else:
        print(f"chosen: {build.variant.name} ({build.variant.variant_id}): {build.variant.changes_from(static_best)}")
    prov = build.provenance
    print(f"board: {prov.get('board')}, search {prov.get('search')}, decision message {prov.get('decision_message')} "
          f"resting on results {prov.get('result_ids')}")
    print("checks: " + ", ".join(f"{k} {'passed' if e.passed else 'FAILED'}" for k, e in checks.items()))
    if build.quality:
        print(f"quality: {build.quality['verdict']} (greedy agreement {build.quality['greedy_agreement']}, "
              f"max |dlogit| {build.quality['max_abs_logit_delta']})")
    print(f"deployment: {dep.status} at {dep.endpoint}: {dep.reason}")
    for mat in result.asset_materializations_for_node("engine_build")[:1]:
        if mat.metadata.get("artifact"):
            print(f"build: {mat.metadata['artifact'].value}")
    for mat in result.asset_materializations_for_node("slow_bench_results")[:1]:
        plots = mat.metadata.get("plot files")
        for title, path in (plots.value if plots else {}).items():
            print(f"plot, {title}: {path}")


def cmd_tune(args: argparse.Namespace) -> int:
    import os

    from assets.resources import EngineRunner, TrafficSource, VariantSource, search_config
    from engine.errors import ConfigError
    from ops.search.llm_agent import LLMAgent
    from ops.search.board import Board
    from ops.search.tune import Budget, default_agents, tune

    if args.budget < 2:
        raise ConfigError("--budget must allow at least 2 experiments (the baseline on both tiers)")
    if not Path(args.trace).is_file():
        raise ConfigError(f"trace not found: {args.trace}")
    runner = EngineRunner(model=args.model, device=args.device, dtype=args.dtype, fast_layers=args.fast_layers,
                          num_kv_blocks=args.num_kv_blocks, layout_devices=args.layout_devices or 0)
    traffic = TrafficSource(trace=args.trace, max_requests=args.requests, max_input=args.max_input,
                            max_output=args.max_output, time_scale=args.time_scale, lenient=args.lenient)
    cfg = search_config(runner, traffic, slow_layers=args.slow_layers, slow_repeats=args.repeats,
                        slo_ttft_s=args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None,
                        slo_tpot_s=args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None)
    board = Board(args.board)
    llm = None
    if args.llm_base_url:
        key = os.environ.get(args.llm_api_key_env, "") if args.llm_api_key_env else ""
        llm = LLMAgent(base_url=args.llm_base_url, model=args.llm_model, api_key=key or "none", board=board,
                       timeout_s=args.llm_timeout, max_tokens=args.llm_max_tokens)
    from pipelines.cli.progress import SearchProgress

    # the log lines, and on a terminal a live line below them: stage, experiments per tier, best, time left
    progress = SearchProgress(args.budget_seconds)
    jcfg = VariantSource(judge_seconds=args.judge_seconds or 0.0, judge_top=args.judge_top or 0,
                         allow_latency_trade=args.allow_latency_trade).judge_config(args.device)
    with progress:
        report = tune(cfg, args.board, default_agents(llm), Budget(args.budget, args.budget_seconds),
                      slow_top=args.slow_top, gate=args.gate, log=progress if not args.quiet else (lambda m: None),
                      speculation=args.speculation, precision=args.precision, jcfg=jcfg)
    board.close()
    print(report.text())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2, default=str))
    return 0


def cmd_static_best(args: argparse.Namespace) -> int:
    from engine import resolve
    from engine.config import static_best
    from ops.measure.tiers import SLO
    from ops.measure.static_best_sweep import sweep

    source = resolve(args.model)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3) if args.slo_ttft_ms and args.slo_tpot_ms else None
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    variant, record = sweep(source, args.device, args.dtype, slo, num_kv_blocks=args.num_kv_blocks, log=log)
    print(json.dumps({"static_best": variant.to_json(), "sweep": record}, indent=2))
    if args.write:
        path = static_best.record(source, args.device, args.dtype, variant, record)
        print(f"recorded in {path}", file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from engine.errors import ConfigError
    from ops.search.board import Board
    from ops.measure.hardware import probe
    from ops.search.config import SearchConfig
    from ops.search.worker import Workbench, work

    board = Board(args.board, lease_s=args.lease_s)
    try:
        cfg = SearchConfig.from_json(board.search_config(args.search))
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    bench = Workbench(cfg, probe(cfg.device, size_mb=64))
    stats = work(board, args.search, bench, args.tier, max_experiments=args.max_experiments)
    print(json.dumps({"evaluated": stats.evaluated, "failed": stats.failed, "lost": stats.lost,
                      "result_ids": stats.result_ids, "seconds": round(stats.seconds, 2)}))
    return 0


def add_parsers(sub) -> None:
    op = sub.add_parser("optimize", help="materialize the whole optimization graph in-process (embedded defaults)")
    add_search_args(op)
    op.add_argument("--candidates", type=positive, default=4, help="variants proposed besides the baseline")
    op.add_argument("--artifacts", default=".polyinf/artifacts")
    op.add_argument("--endpoint-url", default="", help="deploy to this server (default: start one on loopback)")
    op.add_argument("--admin-token", default=None, help="the endpoint's admin token")
    op.add_argument("--keep-serving", action="store_true", help="leave the embedded server running")
    op.add_argument("--llm-base-url", default="", help="an OpenAI-compatible server for the LLM agent (off if empty)")
    op.add_argument("--llm-model", default="polyinf", help="the model name on that server")
    op.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=False,
                    help="static-best with prompt-lookup speculation measured on the slow tier too, where the replay "
                         "is real text (default: off: the default replay's short outputs leave it little to gain)")
    op.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with quantized weights (int8; FP8 on a GPU with FP8 tensor cores) measured on "
                         "the slow tier too; the gates judge its quality before it ships (default: on; "
                         "--no-precision saves that slow-tier variant's time)")
    op.add_argument("--verbose", action="store_true", help="Dagster's event log at DEBUG (default: INFO)")
    op.add_argument("--dagster-home", default=None,
                    help="the Dagster instance that records the run (default: $DAGSTER_HOME, else "
                         "dagster/ beside --artifacts); `DAGSTER_HOME=<it> dagster dev` shows it afterwards")
    op.set_defaults(func=cmd_optimize)

    tn = sub.add_parser("tune", help="search for a better variant outside Dagster: agents propose, the fast and "
                                     "slow tiers measure, the decision and its reasons are printed")
    add_search_args(tn)
    tn.add_argument("--budget", type=positive, default=12, help="most experiments (fast and slow tier together)")
    tn.add_argument("--budget-seconds", type=seconds, default=900.0, help="most wall time for the search")
    tn.add_argument("--board", default=".polyinf/board.sqlite", help="the SQLite message board and queue")
    tn.add_argument("--slow-layers", type=positive, default=None, help="layers of the slow tier's engine (default: all)")
    tn.add_argument("--slow-top", type=positive, default=2, help="best fast-tier variants measured on the slow tier")
    tn.add_argument("--repeats", type=positive, default=3, help="slow-tier replays per variant")
    tn.add_argument("--num-kv-blocks", type=positive, default=512)
    tn.add_argument("--slo-ttft-ms", type=seconds, default=None,
                    help="TTFT target (default: derived from static-best's unloaded latency on the slice)")
    tn.add_argument("--slo-tpot-ms", type=seconds, default=None, help="TPOT target (default: derived likewise)")
    tn.add_argument("--layout-devices", type=positive, default=None,
                    help="devices a parallel layout may span (default: the GPUs with --device cuda, else 1): above 1 "
                         "the search also measures static-best as tensor-parallel ranks and as data-parallel replicas "
                         "(each layout served over HTTP, static-best too; on a CPU, process groups sharing its cores)")
    tn.add_argument("--lenient", action="store_true", help="skip malformed trace rows")
    tn.add_argument("--gate", action="store_true", help="run the quality and contamination gates on the choice")
    tn.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with prompt-lookup speculation measured on the slow tier too, where the replay "
                         "is real text (default: on)")
    tn.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True,
                    help="static-best with quantized weights (int8; FP8 on a GPU with FP8 tensor cores) measured on "
                         "the slow tier too; where it measures at least as good as static-best, the gates judge it "
                         "and a failed gate excludes it (default: on)")
    tn.add_argument("--llm-base-url", default="", help="an OpenAI-compatible server for the LLM agent (off if empty)")
    tn.add_argument("--llm-model", default="polyinf", help="the model name on that server")
    tn.add_argument("--llm-api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    tn.add_argument("--llm-timeout", type=seconds, default=120.0)
    tn.add_argument("--llm-max-tokens", type=positive, default=512)
    tn.add_argument("--json", default=None, help="also write the report as JSON here")
    tn.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    tn.set_defaults(func=cmd_tune)

    sb = sub.add_parser("static-best", help="sweep kernels, graphs and knobs on a fixed synthetic workload: the "
                                            "model's default configuration on this device (static-best)")
    sb.add_argument("--model", default="smollm2")
    sb.add_argument("--device", default="cpu")
    sb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    sb.add_argument("--num-kv-blocks", type=positive, default=1024)
    sb.add_argument("--slo-ttft-ms", type=seconds, default=None, help="default: derived from unloaded latency")
    sb.add_argument("--slo-tpot-ms", type=seconds, default=None)
    sb.add_argument("--write", action="store_true", help="record the result in engine/data/static_best.json")
    sb.set_defaults(func=cmd_static_best)

    wk = sub.add_parser("worker", help="a benchmark worker: drain a search's experiment queue from the board")
    wk.add_argument("--board", required=True)
    wk.add_argument("--search", required=True, help="the search id (printed by 'polyinf tune')")
    wk.add_argument("--tier", choices=["fast", "slow"], default=None, help="only this tier's experiments")
    wk.add_argument("--max-experiments", type=positive, default=None)
    wk.add_argument("--lease-s", type=seconds, default=60.0, help="a claim lapses this long after the last heartbeat")
    wk.set_defaults(func=cmd_worker)
