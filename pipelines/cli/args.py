"""Argument types and the argument groups several commands share (the model, the engine, a search)."""
from __future__ import annotations

import argparse

def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def seconds(text: str, allow_zero: bool = False) -> float:
    """argparse type: a finite number > 0 (>= 0 with ``allow_zero``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 if allow_zero else v > 0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>= 0' if allow_zero else '> 0'}, got {text}")
    return v


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def scale(text: str) -> float:
    """argparse type: a time scale, a finite number >= 0."""
    return seconds(text, allow_zero=True)


MODEL_HELP = ("alias (smollm2), a .gguf file, a Hugging Face model folder (config.json + safetensors) or a model id "
              "already in the local Hugging Face cache (nothing is downloaded), or a preset name or config.json file "
              "for synthetic weights (llama-3.1-8b, qwen3-30b-a3b)")


def add_model_args(p: argparse.ArgumentParser, positional: bool = False, parallel: bool = False) -> None:
    """``positional``: the model may also be given as the first argument (vLLM's ``serve MODEL``); ``parallel``:
    vLLM's ``-tp/--tensor-parallel-size`` and ``-dp/--data-parallel-size`` (the variant's ``tp`` and ``dp``)."""
    if positional:
        p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model, as --model")
    if parallel:
        p.add_argument("-tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=positive, default=None,
                       help="tensor-parallel ranks, one process each (the variant's tp; default: the variant's)")
        p.add_argument("-dp", "--data-parallel-size", dest="data_parallel_size", type=positive, default=None,
                       help="serve: whole replicas of the engine (each with its tp ranks) behind one router (the "
                            "variant's dp; default: the variant's)")
    p.add_argument("--model", required=not positional, help=MODEL_HELP)
    p.add_argument("--synthetic", action="store_true", help="random weights from the model's config (fixed seed)")
    p.add_argument("--seed", type=int, default=0, help="seed for synthetic weights")
    p.add_argument("--layers", type=positive, default=None, help="load only the first N decoder layers")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--num-kv-blocks", type=positive, default=None, help="KV-cache blocks (default: fill --kv-cache-mb)")
    p.add_argument("--kv-cache-mb", type=positive, default=512, help="KV-cache memory when --num-kv-blocks is not set")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="on a GPU: the fraction of its memory the weights and the KV cache may take (the KV cache "
                        "gets what the loaded weights leave of it), instead of --kv-cache-mb")
    p.add_argument("--max-model-len", type=positive, default=None)
    p.add_argument("--variant", default=None,
                   help="a VariantSpec JSON file (see 'polyinf variants show'); default: the model's static-best on "
                        "this device (polyinf static-best), else VariantSpec's defaults")
    add_knob_args(p)


# vLLM's spellings of knob flags, accepted beside ours
KNOB_ALIASES = {"weight_dtype": ("--quantization",)}


def add_knob_args(p: argparse.ArgumentParser) -> None:
    """One flag per VariantSpec knob (its one definition): set, it overrides the variant's value."""
    from engine.config.variant import VariantSpec

    for f in VariantSpec.knob_fields():
        flag = ("--" + f.name.replace("_", "-"), *KNOB_ALIASES.get(f.name, ()))
        what = f"{f.metadata['help']} (default: the variant's; VariantSpec's own is {f.default})"
        if f.metadata["schema"].get("type") == "boolean":
            p.add_argument(*flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=what)
        elif "enum" in f.metadata["schema"] and "type" not in f.metadata["schema"]:
            p.add_argument(*flag, dest=f.name, choices=f.metadata["schema"]["enum"], default=None, help=what)
        else:
            p.add_argument(*flag, dest=f.name, type=_knob_type(f.metadata["schema"]), default=None, help=what)


def _knob_type(schema: dict):
    """argparse type of a knob from its JSON schema: a number in its range, or an integer >= its minimum."""
    low, high = schema.get("minimum", 1), schema.get("maximum")

    def parse(text: str):
        try:
            v = float(text) if schema.get("type") == "number" else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a number' if schema.get('type') == 'number' else 'an integer'}"
                                             f", got {text!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high if high is not None else 'inf'}], got {v}")
        return v
    return parse


def engine_config(args: argparse.Namespace, with_variant_file: bool = True):
    """The EngineConfig the model flags describe; its variant is ``--variant`` (unless ``with_variant_file`` is
    False) or the model's static-best, with the knob flags given on top."""
    import dataclasses

    from engine import EngineConfig, resolve
    from engine.errors import ConfigError
    from engine.config.variant import VariantSpec

    model = getattr(args, "model_arg", None)
    if model is not None and args.model is not None and model != args.model:
        raise ConfigError(f"the model is given twice: {model!r} and --model {args.model!r}")
    model = model or args.model
    if model is None:
        raise ConfigError("no model: give it as the first argument or --model")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    config = EngineConfig(
        source=resolve(model, synthetic=args.synthetic, seed=args.seed),
        device=args.device,
        dtype=dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        layers=args.layers,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_mb * 1024**2,
        max_model_len=args.max_model_len,
        variant=VariantSpec.load(args.variant) if args.variant and with_variant_file else None,
    )
    knobs = {f.name: getattr(args, f.name) for f in VariantSpec.knob_fields() if getattr(args, f.name) is not None}
    if getattr(args, "tensor_parallel_size", None) is not None:
        knobs["tp"] = args.tensor_parallel_size
    if getattr(args, "data_parallel_size", None) is not None:
        knobs["dp"] = args.data_parallel_size
    if knobs:
        config = dataclasses.replace(config, variant=dataclasses.replace(config.initial_variant(), **knobs))
    return config


def add_search_args(p: argparse.ArgumentParser) -> None:
    """The model, trace slice and tiers a search (optimize, tune) measures."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trace", required=True, help="the traffic to tune for (Azure CSV, Mooncake JSONL, capture)")
    p.add_argument("--requests", type=positive, default=16,
                   help="requests from the start of the trace the slow tier replays at its own rate (the judge's "
                        "windows follow them; the trace's last third is held out for confirmation)")
    p.add_argument("--max-input", type=positive, default=64, help="clip prompt lengths (a CPU-sized slice)")
    p.add_argument("--max-output", type=positive, default=8, help="clip output lengths")
    p.add_argument("--time-scale", type=scale, default=1.0,
                   help="multiply the trace's arrival times (1: as recorded; the slice's rate over it is the "
                        "traffic's observed rate)")
    p.add_argument("--judge-seconds", type=seconds, default=None,
                   help="the judge's budget: lockstep capacity searches and the held-out confirmation (default: "
                        "140 s on a CPU, 600 s on a GPU)")
    p.add_argument("--judge-top", type=positive, default=None,
                   help="candidates the judge replays against static-best, the simulator's best (default: 1 on a "
                        "CPU, 2 on a GPU; Holm's correction over them)")
    p.add_argument("--allow-latency-trade", action="store_true",
                   help="adopt a capacity gain even where p50/p99 TTFT or TPOT at the traffic's own rate is worse by "
                        "more than 5% (the report names the trade)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--fast-layers", type=positive, default=4, help="layers of the fast tier's engine")
