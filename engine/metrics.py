"""Prometheus metrics of a serving engine, under vLLM's metric names where one exists."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str = "model") -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", buckets=_LATENCY,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests.", ["finished_reason"], registry=r)
        # prompt-lookup speculation, under vLLM's spec-decode names
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Drafts verified.", registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.", ["position"],
                                             registry=r)
        self._seen_queries = self._seen_hits = 0
        self._seen_spec = (0, 0, 0)
        self._seen_pos: list[int] = []

    def sync_prefix_cache(self, queries: int, hits: int) -> None:
        """The block manager keeps running totals; counters take the increase (a rebuilt pool restarts at 0)."""
        if queries < self._seen_queries or hits < self._seen_hits:
            self._seen_queries = self._seen_hits = 0
        if queries > self._seen_queries:
            self.prefix_queries.inc(queries - self._seen_queries)
            self._seen_queries = queries
        if hits > self._seen_hits:
            self.prefix_hits.inc(hits - self._seen_hits)
            self._seen_hits = hits

    def sync_speculation(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        """The engine keeps running totals; counters take the increase."""
        for counter, now, seen in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted),
                                      (drafts, draft_tokens, accepted), self._seen_spec):
            if now > seen:
                counter.inc(now - seen)
        self._seen_spec = (drafts, draft_tokens, accepted)
        for pos, n in enumerate(per_pos):
            seen = self._seen_pos[pos] if pos < len(self._seen_pos) else 0
            if n > seen:
                self.spec_accepted_per_pos.labels(position=str(pos)).inc(n - seen)
        self._seen_pos = list(per_pos)
