"""Prometheus metrics of a serving engine, under vLLM's metric names where one exists."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)


class _Labelled:
    """A labelled metric whose ``model_name`` label is already set: ``.labels(**others)`` as the parent's."""

    def __init__(self, parent, model_name: str) -> None:
        self._parent, self._model = parent, model_name

    def labels(self, **kw):
        return self._parent.labels(model_name=self._model, **kw)


class EngineMetrics:
    """Every series carries vLLM's ``model_name`` label (its Grafana dashboard filters on it)."""

    def __init__(self, model_name: str = "model") -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name

        def metric(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
            parent = kind(name, doc, ["model_name", *labels], registry=r, **kw)
            return _Labelled(parent, model_name) if labels else parent.labels(model_name=model_name)

        self.running = metric(Gauge, "vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = metric(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.")
        self.prefix_queries = metric(Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metric(Counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = metric(Counter, "vllm:num_preemptions", "Requests preempted (their KV recomputed later).")
        self.ttft = metric(Histogram, "vllm:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY)
        self.itl = metric(Histogram, "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                          buckets=_LATENCY)
        self.e2e = metric(Histogram, "vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                          buckets=_LATENCY)
        self.prompt_tokens = metric(Counter, "vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Generated tokens of finished requests.")
        self.request_success = metric(Counter, "vllm:request_success", "Finished requests.", ("finished_reason",))
        # prompt-lookup speculation, under vLLM's spec-decode names
        self.spec_drafts = metric(Counter, "vllm:spec_decode_num_drafts", "Drafts verified.")
        self.spec_draft_tokens = metric(Counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = metric(Counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = metric(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                            "Draft tokens accepted, by position in the draft.", ("position",))
        # the active engine variant: 1 for its id (the tuner's hot swaps show as a change of label)
        self._variant = Gauge("polyinf:active_variant_info", "The active engine variant (value 1).",
                              ["model_name", "variant_id", "variant_name"], registry=r)
        self._variant_labels: tuple[str, str] | None = None
        self._seen_queries = self._seen_hits = self._seen_preemptions = 0
        self._seen_spec = (0, 0, 0)
        self._seen_pos: list[int] = []

    def set_variant(self, variant_id: str, name: str) -> None:
        if self._variant_labels == (variant_id, name):
            return
        if self._variant_labels is not None:
            self._variant.remove(self.model_name, *self._variant_labels)
        self._variant.labels(model_name=self.model_name, variant_id=variant_id, variant_name=name).set(1)
        self._variant_labels = (variant_id, name)

    def sync_preemptions(self, total: int) -> None:
        """The engine keeps a running total; the counter takes the increase."""
        if total > self._seen_preemptions:
            self.preemptions.inc(total - self._seen_preemptions)
        self._seen_preemptions = max(total, self._seen_preemptions)

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
