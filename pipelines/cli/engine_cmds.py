"""Engine commands: generate, serve, check (the gates), bench (one variant on a tier), variants."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipelines.cli.args import add_model_args, engine_config, positive, scale, seconds


def _generate(rank: int, config, prompt: str, params, chat: bool) -> dict:
    """One engine (one rank of a tensor-parallel group) generating for one prompt."""
    import dataclasses

    from engine import LLMEngine
    from engine.model.parallel import rank_device

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
    from engine.model.parallel import run_ranks

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.sample_seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    config = engine_config(args)
    tp = config.initial_variant().tp
    if config.initial_variant().dp > 1:
        from engine.errors import ConfigError

        raise ConfigError("generate runs one prompt on one engine: data-parallel replicas (-dp) are for serve")
    if tp > 1:  # one process per rank (GPU i for rank i, or gloo on CPU); rank 0 reports
        from engine.loader.model_source import load_config
        from engine.model.parallel import shard_config

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


def cmd_serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    name = args.served_model_name or args.model_arg or args.model
    kw = dict(host=args.host, port=args.port, admin_token=args.admin_token, api_key=args.api_key,
              capture_dir=args.capture_dir, capture_prompts=args.capture_prompts, log_level=args.log_level)
    if config.initial_variant().dp > 1:  # replicas behind a router in this process
        from engine.entrypoints.router import serve_replicas

        serve_replicas(config, name, **kw)
    else:  # with tp > 1, this process is rank 0 and starts the others
        from engine.entrypoints.server import serve

        serve(config, name, **kw)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from checks.gates import gate_variant
    from checks.prompts import shipped_prompts, trace_prompts
    from engine import LLMEngine
    from engine.errors import ConfigError
    from engine.config.variant import VariantSpec

    if not args.variant:
        raise ConfigError("check needs --variant FILE")
    spec = VariantSpec.load(args.variant)
    import dataclasses

    config = engine_config(args, with_variant_file=False)  # the weights' engine; the gates build both forms
    base = LLMEngine(dataclasses.replace(config, variant=VariantSpec(name="reference"), num_kv_blocks=8))
    prompts = shipped_prompts(base)
    if args.trace:
        from ops.traffic.traces import load_trace

        records = load_trace(args.trace, lenient=args.lenient)[: args.trace_prompts]
        prompts += trace_prompts([min(r.input_tokens, args.max_input) for r in records], base.model_config.vocab_size)
    from checks.report import thresholds_for

    t = thresholds_for(config.dtype, spec.weight_dtype, spec.kv_cache_dtype)
    thresholds = dataclasses.replace(  # the rounding tolerance of contamination kept from the defaults
        t, min_greedy_agreement=t.min_greedy_agreement if args.min_agreement is None else args.min_agreement,
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
    from engine.errors import ConfigError
    from ops.measure.tiers import SLO, fast_tier, slow_tier

    engine = LLMEngine(engine_config(args))
    if args.tier == "fast":
        result = fast_tier(engine, args.prefill_lengths, [(b, args.context) for b in args.decode_batches],
                           repeats=args.repeats)
    else:
        from ops.traffic.replay import synthesize_prompts
        from ops.traffic.traces import load_trace

        if not args.trace:
            raise ConfigError("the slow tier needs --trace")
        records = load_trace(args.trace, lenient=args.lenient)[: args.requests]
        prompts = synthesize_prompts(records, engine.model_config.vocab_size, max_input=args.max_input)
        result = slow_tier(engine, records, prompts, f"{Path(args.trace).name}[:{len(records)}]",
                           repeats=args.repeats, time_scale=args.time_scale, max_output=args.max_output,
                           slo=SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
    print(json.dumps(result.to_json(), indent=2))
    return 0


def cmd_variants_show(args: argparse.Namespace) -> int:
    from engine.config.variant import REFERENCE_VARIANT, VariantSpec

    spec = VariantSpec.load(args.variant) if args.variant else REFERENCE_VARIANT
    print(json.dumps(spec.to_json(), indent=2))
    return 0


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt and print it with tokens/s")
    add_model_args(g, parallel=True)
    g.add_argument("--prompt", required=True, help="prompt text (token ids, space separated, for synthetic models)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=positive, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, prompt_token_ids")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (vLLM's flag names: "
                                      "serve MODEL, --served-model-name, --api-key, --gpu-memory-utilization, "
                                      "--enable-prefix-caching, --max-num-seqs, --kv-cache-dtype, --quantization, "
                                      "-tp, -dp)")
    add_model_args(sv, positional=True, parallel=True)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    sv.add_argument("--capture-dir", default=None, help="append every finished request as a TraceRecord here")
    sv.add_argument("--capture-prompts", action="store_true", help="also capture prompt text (off by default)")
    sv.add_argument("--admin-token", default=None,
                    help="bearer token for /admin endpoints (default: $POLYINF_ADMIN_TOKEN; none disables them)")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer <key>' on the OpenAI routes (default: $POLYINF_API_KEY, else "
                         "$VLLM_API_KEY; none: open). On the command line other local users can read it")
    sv.add_argument("--log-level", default="warning")
    sv.set_defaults(func=cmd_serve)

    ck = sub.add_parser("check", help="run the quality and KV-cache contamination gates on a variant")
    add_model_args(ck)
    ck.add_argument("--trace", default=None, help="add prompts shaped like this trace's requests")
    ck.add_argument("--trace-prompts", type=positive, default=4, help="how many trace-shaped prompts")
    ck.add_argument("--max-input", type=positive, default=256, help="clip trace-shaped prompts to this length")
    ck.add_argument("--lenient", action="store_true")
    ck.add_argument("--max-tokens", type=positive, default=12, help="tokens generated per prompt")
    ck.add_argument("--exact", action="store_true", help="the variant claims bit-identical results")
    ck.add_argument("--min-agreement", type=float, default=None, help="override the dtype's greedy-agreement floor")
    ck.add_argument("--max-logit-delta", type=float, default=None, help="override the dtype's max |delta logit|")
    ck.add_argument("--max-kl", type=float, default=None, help="override the dtype's mean-KL ceiling")
    ck.add_argument("--json", default=None, help="also write the QualityReport here")
    ck.set_defaults(func=cmd_check)

    bn = sub.add_parser("bench", help="measure the engine (one variant) on the fast or slow tier; prints a BenchResult")
    add_model_args(bn)
    bn.add_argument("--tier", choices=["fast", "slow"], default="slow")
    bn.add_argument("--trace", default=None, help="slow tier: the trace whose slice is replayed")
    bn.add_argument("--lenient", action="store_true")
    bn.add_argument("--requests", type=positive, default=16, help="slow tier: requests from the start of the trace")
    bn.add_argument("--time-scale", type=scale, default=1.0, help="slow tier: multiply arrival times")
    bn.add_argument("--max-input", type=positive, default=None, help="slow tier: clip prompt lengths")
    bn.add_argument("--max-output", type=positive, default=None, help="slow tier: clip output lengths")
    bn.add_argument("--slo-ttft-ms", type=seconds, default=2000.0)
    bn.add_argument("--slo-tpot-ms", type=seconds, default=200.0)
    bn.add_argument("--prefill-lengths", type=positive, nargs="+", default=[128, 512], help="fast tier")
    bn.add_argument("--decode-batches", type=positive, nargs="+", default=[1, 8, 32], help="fast tier")
    bn.add_argument("--context", type=positive, default=256, help="fast tier: decode context length")
    bn.add_argument("--repeats", type=positive, default=3)
    bn.set_defaults(func=cmd_bench)

    v = sub.add_parser("variants", help="engine variants (VariantSpec JSON)")
    vsub = v.add_subparsers(dest="variants_command", required=True)
    show = vsub.add_parser("show", help="print a variant as JSON with its variant_id (default: the reference variant)")
    show.add_argument("--variant", default=None, help="a VariantSpec JSON file to validate and print")
    show.set_defaults(func=cmd_variants_show)
