"""Replaying a trace against any OpenAI-compatible endpoint, and the latency report vLLM's `bench serve` gives.

Prompts are synthesized as token ids of the recorded input lengths; requests that share
prefix-block hashes share the same prefix tokens (each hash id maps to a fixed block of
tokens). With the model's tokenizer the ids are real text (``ops.traffic.corpus``), else random ids
(synthetic weights). max_tokens follows the recorded output, with ``ignore_eos`` so lengths hold.
Definitions follow vLLM: TTFT is the time to the first streamed token; TPOT is
(e2e - TTFT) / (output tokens - 1); ITL is every gap between streamed chunks; goodput counts
requests per second that meet every SLO given.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

from engine.serving.trace_record import TraceRecord
from ops.traffic.corpus import Corpus, TextTokenizer, corpus_for, corpus_ids, text_prompts
from ops.traffic.traces import percentile


@dataclass
class RequestResult:
    ok: bool
    input_tokens: int
    output_tokens: int  # as reported by the server's usage, else counted from chunks
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""
    lag: float = 0.0  # seconds the load generator sent it after its scheduled time


@dataclass
class ReplayReport:
    requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # requests/s meeting every SLO; None when no SLO was given
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]
    # every request's own figures (vllm_result's lists and percentiles); not in report_json's summary
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def table(self) -> str:
        rows = [("requests (completed / failed)", f"{self.completed} / {self.failed}"),
                ("duration (s)", f"{self.duration_s:.2f}"),
                ("input / output tokens", f"{self.total_input_tokens} / {self.total_output_tokens}"),
                ("request throughput (req/s)", f"{self.request_throughput:.2f}"),
                ("output token throughput (tok/s)", f"{self.output_throughput:.1f}"),
                ("total token throughput (tok/s)", f"{self.total_token_throughput:.1f}")]
        if self.goodput is not None:
            rows.append(("goodput (req/s)", f"{self.goodput:.2f}"))
        for name, d in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms), ("E2E", self.e2e_ms)):
            rows.append((f"{name} ms mean / p50 / p90 / p99",
                         f"{d['mean']:.1f} / {d['p50']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else 0.0
    return {"mean": 1e3 * mean, **{f"p{int(100 * q)}": 1e3 * percentile(values, q) for q in (0.5, 0.9, 0.99)}}


def synthesize_prompts(records: list[TraceRecord], vocab_size: int, max_input: int | None = None,
                       seed: int = 0, low: int = 100, *, tokenizer: TextTokenizer | None = None,
                       corpus: Corpus | str | None = None) -> list[list[int]]:
    """Token ids per record. Blocks named by the same hash id get the same tokens, so shared
    prefixes in the trace are shared prefixes here; the rest differs per request.

    Without a tokenizer the ids are random in [low, vocab_size) (synthetic weights). With one
    they are windows of real text from ``corpus`` (``corpus_for(records)`` when None): see
    ``ops.traffic.corpus.text_prompts``; ``low`` is then unused.
    """
    if tokenizer is not None:
        stream = corpus_ids(corpus if corpus is not None else corpus_for(records), tokenizer)
        if stream.max_id >= vocab_size:
            raise ValueError(f"the tokenizer's ids reach {stream.max_id} but the vocabulary has {vocab_size}: "
                             "a tokenizer of another model?")
        return text_prompts(records, stream, max_input=max_input, seed=seed)
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    low = min(low, vocab_size // 4)  # skip the (often special) first ids, but stay inside small vocabularies
    high = vocab_size - 1
    out = []
    for r in records:
        n = r.input_tokens if max_input is None else min(r.input_tokens, max_input)
        n = max(1, n)
        ids: list[int] = []
        for h in r.prefix_block_hashes:
            if len(ids) >= n:
                break
            if h not in blocks:
                brng = random.Random(hash((seed, h)))
                blocks[h] = [brng.randint(low, high) for _ in range(r.block_tokens)]
            ids.extend(blocks[h])
        ids.extend(rng.randint(low, high) for _ in range(max(0, n - len(ids))))
        out.append(ids[:n])
    return out


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False, input_tokens=len(prompt), output_tokens=0)
    last = None
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
            choice = chunk.choices[0] if chunk.choices else None
            # a chunk brings tokens if it has text, or token ids (a server without a tokenizer)
            if choice is not None and choice.text:
                res.text += choice.text
            if choice is not None and (choice.text or (getattr(choice, "model_extra", None) or {}).get("token_ids")):
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # one failed request does not stop the replay
        res.error = f"{type(e).__name__}: {e}"
    return res


async def replay_async(records: list[TraceRecord], prompts: list[list[int]], base_url: str, model: str,
                       time_scale: float = 1.0, max_output: int | None = None, max_concurrency: int | None = None,
                       slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                       api_key: str = "EMPTY", timeout: float = 600.0, slo_e2el_ms: float | None = None) -> ReplayReport:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = records[0].arrival_s if records else 0.0
    start = time.perf_counter()

    async def fire(r: TraceRecord, p: list[int]) -> RequestResult:
        due = (r.arrival_s - t0) * time_scale
        delay = due - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        out = r.output_tokens if max_output is None else min(r.output_tokens, max_output)
        lag = max(0.0, time.perf_counter() - start - due)
        if sem is None:
            res = await _one(client, model, p, max(1, out))
        else:
            async with sem:
                res = await _one(client, model, p, max(1, out))
        res.lag = lag
        return res

    results = await asyncio.gather(*(fire(r, p) for r, p in zip(records, prompts)))
    duration = time.perf_counter() - start
    await client.close()
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None or slo_e2el_ms is not None:
        def meets(r):
            tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            return ((slo_ttft_ms is None or 1e3 * r.ttft <= slo_ttft_ms)
                    and (slo_tpot_ms is None or 1e3 * tpot <= slo_tpot_ms)
                    and (slo_e2el_ms is None or 1e3 * r.e2e <= slo_e2el_ms))
        good = sum(1 for r in ok if meets(r)) / duration
    tin, tout = sum(r.input_tokens for r in ok), sum(r.output_tokens for r in ok)
    return ReplayReport(
        requests=len(results), completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        total_input_tokens=tin, total_output_tokens=tout, request_throughput=len(ok) / duration,
        output_throughput=tout / duration, total_token_throughput=(tin + tout) / duration, goodput=good,
        ttft_ms=_stats([r.ttft for r in ok]), tpot_ms=_stats(tpots),
        itl_ms=_stats([x for r in ok for x in r.itl]), e2e_ms=_stats([r.e2e for r in ok]),
        errors=[r.error for r in results if not r.ok][:10], results=list(results),
    )


def report_json(report: ReplayReport) -> str:
    d = asdict(report)
    d.pop("results")
    return json.dumps(d, indent=2)


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str]) -> dict[str, float]:
    """vLLM's ``--goodput ttft:2000 tpot:200`` (milliseconds; keys ttft, tpot, e2el) -> {key: ms}."""
    out = {}
    for item in items:
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or key not in GOODPUT_KEYS or not ms > 0 or ms == float("inf"):
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_KEYS)}, got {item!r}")
        out[key] = ms
    return out


def vllm_result(report: ReplayReport, model: str, *, metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
                percentiles: tuple[float, ...] = (99.0,), max_concurrency: int | None = None,
                request_rate: float | str = "inf", goodput: dict[str, float] | None = None) -> dict:
    """The replay in ``vllm bench serve --save-result``'s keys and units: milliseconds in the ``*_ms`` figures,
    seconds in ``ttfts`` and ``itls``, ``request_goodput`` for the --goodput SLOs (None without them)."""
    ok = [r for r in report.results if r.ok]
    per = {"ttft": [r.ttft for r in ok], "e2el": [r.e2e for r in ok],
           "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
           "itl": [x for r in ok for x in r.itl]}
    out = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model, "tokenizer_id": model,
           "num_prompts": report.requests, "request_rate": request_rate, "burstiness": 1.0,
           "max_concurrency": max_concurrency, "duration": report.duration_s, "completed": report.completed,
           "failed": report.failed, "total_input_tokens": report.total_input_tokens,
           "total_output_tokens": report.total_output_tokens, "request_throughput": report.request_throughput,
           "request_goodput": report.goodput if goodput else None, "output_throughput": report.output_throughput,
           "total_token_throughput": report.total_token_throughput,
           "input_lens": [r.input_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
           "ttfts": per["ttft"], "itls": [list(r.itl) for r in ok], "generated_texts": [r.text for r in ok],
           "errors": [r.error for r in report.results if not r.ok]}
    for m in metrics:
        values = per[m]
        mean = sum(values) / len(values) if values else 0.0
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 if values else 0.0
        out[f"mean_{m}_ms"], out[f"median_{m}_ms"], out[f"std_{m}_ms"] = 1e3 * mean, 1e3 * percentile(values, 0.5), 1e3 * std
        for p in percentiles:
            out[f"p{p:g}_{m}_ms"] = 1e3 * percentile(values, p / 100)
    return out


def replay_in_child(records: list[TraceRecord], prompts: list[list[int]], base_url: str, model: str,
                    time_scale: float = 1.0, max_output: int | None = None, timeout: float = 900.0
                    ) -> list[RequestResult]:
    """``replay_async``'s per-request results, from a client process of its own (``python -m ops.traffic.replay``),
    as a client on another host would send them: nothing the calling process does meanwhile (its other threads,
    its own work) holds its interpreter while a send is due. The child gets no secret of this environment."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from engine.generated.isolation import project_env

    root = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory(prefix="polyinf-replay-") as d:
        job, out = Path(d) / "window.json", Path(d) / "results.json"
        job.write_text(json.dumps({"records": [asdict(r) for r in records], "prompts": prompts, "url": base_url,
                                   "model": model, "time_scale": time_scale, "max_output": max_output}))
        env = project_env()
        try:
            proc = subprocess.run([sys.executable, "-m", "ops.traffic.replay", str(job), str(out)], env=env, cwd=root,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the replay's client did not finish in {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"the replay's client failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
        return [RequestResult(**r) for r in json.loads(out.read_text())]


def _child(job_path: str, out_path: str) -> None:
    from pathlib import Path

    job = json.loads(Path(job_path).read_text())
    records = [TraceRecord(**{**r, "prefix_block_hashes": tuple(r["prefix_block_hashes"])}) for r in job["records"]]
    rep = asyncio.run(replay_async(records, job["prompts"], job["url"], job["model"], time_scale=job["time_scale"],
                                   max_output=job["max_output"], timeout=600))
    Path(out_path).write_text(json.dumps([asdict(r) for r in rep.results]))


if __name__ == "__main__":
    import sys

    _child(*sys.argv[1:3])
