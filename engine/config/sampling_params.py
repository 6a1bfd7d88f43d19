"""Per-request sampling parameters, validated once."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestError

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # per-request generator, so sampled output does not depend on neighbours
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the output text is cut before the first one
    ignore_eos: bool = False
    # Teacher forcing, for quality gates: emit these tokens instead of sampling (logits are still computed).
    forced_tokens: tuple[int, ...] = ()
    # OpenAI's penalties over the generated tokens: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and transformers'): a token of the prompt or the output has its logit divided by it if positive,
    # multiplied if negative; 1 leaves the logits alone
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # the sampled token's log-probability and this many of the most likely ones
    # decoding constrained to this JSON schema (its JSON text; engine/worker/structured.py), or None
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0 or self.temperature != self.temperature or self.temperature == float("inf"):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < float("inf"):
            raise RequestError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        bias = tuple((t, b) for t, b in self.logit_bias)
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or isinstance(b, bool)
               or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0 for t, b in bias):
            raise RequestError("logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.json_schema is not None and (not isinstance(self.json_schema, str) or not self.json_schema.strip()):
            raise RequestError("json_schema must be a JSON schema's text")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "forced_tokens", tuple(self.forced_tokens))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling (penalties, biases): the token needs the request's history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def per_token(self) -> bool:
        """Whether each token is chosen on the host with the request's own state (adjusted logits,
        log-probabilities to report, a grammar): no device-side argmax, no speculative drafts."""
        return self.adjusts_logits or self.logprobs is not None or self.json_schema is not None
