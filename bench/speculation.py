"""Prompt-lookup speculation on real weights: batch-1 decode of SmolLM2 (or any model with a tokenizer) with
and without speculation, on text of three kinds, measured in alternation within one run.

Kinds: ``edit`` (a standard-library function to be rewritten with small changes: output copies the prompt),
``summary`` (documentation prose to be summarized: some copying), ``chat`` (open questions: little to copy).
Each prompt is answered greedily with speculation off and with each draft length of --tokens, alternating
(off, k1, k2, ..., off, k1, ...) --rounds times; the table gives output tokens/s (median over rounds), the
ratio to speculation off in the same run, the acceptance rate and the tokens per verified draft, and checks
that every speculative answer equals the plain one token for token.

    .venv/bin/python -m bench speculation                  # SmolLM2 on the CPU
    PYTHONPATH=$PWD python3 -m bench speculation --device cuda --model <dir with the gguf>   # a GPU host
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

from bench.lib import cli
from bench.lib.timing import alternate

ROOT = Path(__file__).resolve().parents[1]


def prompts() -> dict[str, list[str]]:
    """Prompts from texts that ship with Python (nothing downloaded)."""
    import json as json_mod
    import pydoc_data.topics as topics
    import textwrap as tw

    edit = []
    for fn in (tw.dedent, json_mod.dumps, inspect.getdoc):
        src = inspect.getsource(fn)
        src = src[:1200]
        edit.append(f"Rewrite this Python code, renaming the first parameter to `value` and changing nothing "
                    f"else:\n\n```python\n{src}```\n")
    summary = []
    for key in ("assert", "with", "lambda"):
        text = " ".join(topics.topics[key].split())[:1500]
        summary.append(f"Summarize this documentation in a few sentences, quoting its key terms:\n\n{text}\n")
    chat = ["What are three good habits for writing maintainable software? Explain each briefly.",
            "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
            "Why is the sky blue? Explain it to a curious ten-year-old."]
    return {"edit": edit, "summary": summary, "chat": chat}


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    cli.add_model_args(ap)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8], help="draft lengths compared with off")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here")


def main(args: argparse.Namespace) -> int:

    from engine import EngineConfig, LLMEngine, SamplingParams, VariantSpec, resolve

    base = LLMEngine(EngineConfig(source=resolve(args.model), device=args.device, dtype=args.dtype, num_kv_blocks=8))
    if base.tokenizer is None:
        print("speculation is measured on real text: this model has no tokenizer", file=sys.stderr)
        return 2
    engines = {k: LLMEngine.with_loaded(base, EngineConfig(
        source=resolve(args.model), device=args.device, dtype=args.dtype, num_kv_blocks=512,
        variant=VariantSpec(max_num_seqs=1, speculative_tokens=k, speculative_max_batch=1)))
        for k in [0, *args.tokens]}
    params = SamplingParams(max_tokens=args.max_tokens)
    for eng in engines.values():  # warm-up
        eng.generate(["Hello"], SamplingParams(max_tokens=4), chat=True)
    rows = []
    for kind, texts in prompts().items():
        stats: dict[int, list[int]] = {k: [0, 0, 0] for k in engines}
        answers: dict[int, list[list]] = {k: [] for k in engines}  # per round, each prompt's tokens

        def arm(k: int, eng, texts=texts, stats=stats, answers=answers):
            def measure() -> float:
                tokens, seconds = 0, 0.0
                s0 = (eng.stats.spec_drafts, eng.stats.spec_draft_tokens, eng.stats.spec_accepted_tokens)
                outs = []
                for text in texts:
                    t0 = time.perf_counter()
                    out = eng.generate([text], params, chat=True)[0]
                    seconds += time.perf_counter() - t0
                    tokens += len(out.token_ids)
                    outs.append(out.token_ids)
                st = eng.stats
                for i, (now, was) in enumerate(zip((st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens), s0)):
                    stats[k][i] += now - was
                answers[k].append(outs)
                return tokens / seconds
            return measure

        tps = alternate({k: arm(k, eng) for k, eng in engines.items()}, args.rounds)
        equal = all(answers[k] == answers[0] for k in engines)
        off = statistics.median(tps[0])
        for k in engines:
            drafts, drafted, accepted = stats[k]
            rows.append({"kind": kind, "tokens": k, "tok_s": statistics.median(tps[k]),
                         "ratio": statistics.median(tps[k]) / off, "spread": max(tps[k]) - min(tps[k]),
                         "acceptance": accepted / drafted if drafted else 0.0,
                         "per_draft": 1 + accepted / drafts if drafts else 0.0, "equal": equal})
    head = f"{'text':8} {'draft':>5} {'tok/s':>7} {'spread':>7} {'vs off':>7} {'accepted':>9} {'tok/draft':>9}  same tokens"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kind']:8} {r['tokens'] or 'off':>5} {r['tok_s']:7.2f} {r['spread']:7.2f} {r['ratio']:6.2f}x "
              f"{r['acceptance']:8.0%} {r['per_draft']:9.2f}  {'yes' if r['equal'] else 'NO'}")
    print(textwrap.fill(f"model {args.model}, {args.device} {args.dtype}, batch 1, greedy, up to {args.max_tokens} "
                        f"tokens per answer, 3 prompts per kind, median of {args.rounds} alternating rounds", 110))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli.run(__doc__, add_cli_args, main))
