"""The engine: requests in, tokens out, one step at a time.

``step`` is schedule -> launch -> collect (sample, postprocess); everything else hides behind those names.

Decode runs one step ahead of the host (on a GPU; see ``EngineConfig.async_decode``): when a
greedy decode step is launched and nothing waits for admission, the next step of the same
sequences is launched right behind it, its input tokens taken on the device from the first
one's, before the host reads the first one's tokens. The host's work (postprocess, scheduling,
staging) then overlaps the device's. A sequence that stopped meanwhile has its ahead token
dropped: its KV went into a slot of its own that no prefix hash covers, so nothing else ever
reads it.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.sched.block_manager import BlockManager
from engine.config.model_config import ModelConfig
from engine.config.engine_config import EngineConfig
from engine.model import precision
from engine.sched import speculation
from engine.core import variant_swap
from engine.errors import ConfigError, RequestError
from engine.model.forward_ops import ForwardOps
from engine.loader.model_source import load_model
from engine.model.parallel import current_group, shard_model
from engine.worker.model_runner import KVCache, ModelRunner
from engine.model.sampler import sample, top_logprobs
from engine.config.sampling_params import SamplingParams
from engine.sched.output import ScheduledSequence, SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import FinishReason, Sequence, SequenceStatus
from engine.loader.tokenizer import Tokenizer
from engine.config.variant import VariantSpec
from engine.core.variant_swap import PreparedVariant, SwapReport


def _kv_bytes_left(device: torch.device, utilization: float) -> int:
    """What ``utilization`` of the GPU's memory leaves for the KV cache after what this process holds now (the
    weights, loaded)."""
    total = torch.cuda.get_device_properties(device).total_memory
    left = int(total * utilization) - torch.cuda.memory_reserved(device)
    if left <= 0:
        raise ConfigError(f"gpu_memory_utilization {utilization}: the weights already take "
                          f"{torch.cuda.memory_reserved(device) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    return left


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache at the last admission
    num_tokens_run: int  # tokens of this request run through the model (recompute included)
    # with SamplingParams.logprobs: per generated token (token, its log-probability, [(token, logprob)] of the
    # most likely ones)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


@dataclass
class _Launched:
    """A step whose forward pass is queued on the device; its tokens are read when it is collected."""

    batch: SchedulerOutput
    starts: list[int]  # per scheduled row: the sequence's num_computed_tokens when this step's results apply
    # per sampling row, its tokens, sampled on the host at launch (sampling params, forced tokens, a logits sink)
    tokens: list[list[int]] | None
    host_tokens: torch.Tensor | None  # (rows,) int64 greedy tokens, filled by a copy queued behind the step
    ready: torch.cuda.Event | None  # recorded after that copy (GPU only)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # tokens run through the model, prefill, decode and recompute alike
    generation_tokens: int = 0
    preemptions: int = 0
    forward_seconds: float = 0.0
    # prompt-lookup speculation (vLLM's spec_decode counters): drafts verified, their tokens, those accepted,
    # and accepted tokens by position in the draft
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft: the accepted ones plus the target's own (vLLM's mean
        acceptance length)."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0


@dataclass
class LoadedModel:
    """Weights and tokenizer, loaded once; several engines (or variants of one) can share them."""

    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Tokenizer | None
    load_seconds: float

    @classmethod
    def load(cls, config: EngineConfig) -> "LoadedModel":
        """Loads the weights; with a variant of tp > 1, this rank's shard of them (engine.model.parallel)."""
        t0 = time.perf_counter()
        tp = config.initial_variant().tp
        group = current_group(tp) if tp > 1 else None  # fails before loading anything
        model_cfg, model = load_model(config.source, torch.device(config.device), config.torch_dtype, config.layers)
        if group is not None:
            model = shard_model(model, group)  # the whole model is dropped once its shard is copied
            model_cfg = model.config
        tok = Tokenizer(config.source.tokenizer_path) if config.load_tokenizer and config.source.tokenizer_path else None
        return cls(model_cfg, model, tok, time.perf_counter() - t0)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        loaded = loaded or LoadedModel.load(config)
        self.loaded = loaded
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        model_cfg = loaded.config
        self.load_seconds = loaded.load_seconds
        variant = config.initial_variant()
        kv_dtype = precision.kv_cache_dtype(variant.kv_cache_dtype, self.dtype)
        kv_bytes = config.kv_cache_bytes
        if config.gpu_memory_utilization is not None and config.num_kv_blocks is None:
            kv_bytes = _kv_bytes_left(self.device, config.gpu_memory_utilization)
        num_blocks = config.num_kv_blocks or max(
            1, kv_bytes // KVCache.bytes_per_block(model_cfg, variant.block_size, kv_dtype)
        )
        self.kv = KVCache(model_cfg, num_blocks, variant.block_size, self.device, kv_dtype)
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        self.block_manager = BlockManager(num_blocks, variant.block_size, variant.enable_prefix_caching)
        self.scheduler = Scheduler(variant, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, model_cfg, self.kv, self.max_model_len, self.device)
        self.variant: VariantSpec = variant
        self.previous_variant: VariantSpec | None = None
        self.notes: list[str] = []  # what the engine skipped or could not honour, for the operator
        self.ops: ForwardOps | None = None  # the context below reads it; set at once
        ctx = variant_swap.context(self)
        self.ops = variant_swap.build_ops_for(ctx, self.variant)
        self.runner.forward_fn = variant_swap.forward_fn(ctx, self.variant)
        self.runner.install(self.runner.forward_fn, variant_swap.graphs_for(ctx, self.variant, self.ops, self.kv,
                                                                            self.notes))
        self.lock = threading.RLock()  # a swap happens between two steps, never inside one
        self._inflight: _Launched | None = None  # a step launched ahead, not yet collected
        self._drained: list[RequestOutput] = []  # outputs of an ahead step collected by a swap, for the next step
        # Observer of every step's logits: (request ids, (N, vocab) float32). Used by the quality gates.
        self.logits_sink = None
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._constraints: dict = {}  # request id -> its response format's grammar state (engine/worker/structured.py)
        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def with_loaded(cls, other: "LLMEngine", config: EngineConfig) -> "LLMEngine":
        """A new engine with ``config``'s cache and scheduler settings over ``other``'s weights (no reload)."""
        same = (config.source, config.device, config.dtype, config.layers) == (
            other.config.source, other.config.device, other.config.dtype, other.config.layers)
        if not same:
            raise ValueError("with_loaded needs the same model source, device, dtype and layers")
        return cls(config, other.loaded)

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: pass token ids")
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        chat: bool = False,
    ) -> str:
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, chat)
        self.validate(ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        if params.json_schema is not None:  # a copy of the schema's matcher that validate() compiled
            from engine.worker.structured import JsonConstraint

            self._constraints[rid] = JsonConstraint(self.tokenizer, params.json_schema, self.model_config.vocab_size)
        seq = Sequence(rid, ids, params, next(self._arrivals))
        self._seqs[rid] = seq
        if not params.greedy:
            gen = torch.Generator()
            if params.seed is not None:
                gen.manual_seed(params.seed)
            elif self.model.tp is not None:  # every rank must draw the same tokens: seed from the arrival order
                gen.manual_seed(0x9E3779B9 + seq.arrival)
            else:
                gen.manual_seed(torch.seed())
            self._generators[rid] = gen
        self.scheduler.add(seq)
        return rid

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError if the request cannot be served; changes nothing."""
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"prompt token ids must be in 0..{vocab - 1}")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in 0..{vocab - 1}")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_model_len} tokens"
            )
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise RequestError(f"prompt + max_tokens ({total}) exceeds the KV cache ({capacity} tokens)")
        if params.json_schema is not None:  # compiled once and kept: a schema it cannot use is refused here
            from engine.worker.structured import compiled

            compiled(self.tokenizer, params.json_schema, vocab)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.running:
            self.scheduler.finish(seq)
        elif seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self._generators.pop(request_id, None)
        self._constraints.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._drained)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self._drained:
            out, self._drained = self._drained, []
            return out
        launched, self._inflight = self._inflight, None
        if launched is None or not any(self._live(launched)):
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return []
            launched = self._launch(batch)
        if self._can_run_ahead(launched):
            self._inflight = self._launch(SchedulerOutput(list(launched.batch.scheduled)), ahead=True)
        return self._collect(launched)

    def _launch(self, batch: SchedulerOutput, ahead: bool = False) -> _Launched:
        """Queues the step's forward pass. Greedy steps leave their tokens on the device (copied back
        asynchronously); others sample on the host now."""
        t0 = time.perf_counter()
        logits = self.runner.run(batch, self.ops, ahead)
        starts = [s.seq.num_computed_tokens + int(ahead) for s in batch.scheduled]
        samplers = [s for s in batch.scheduled if s.samples]
        if samplers and self.logits_sink is None and all(
                s.seq.params.greedy and not s.seq.params.forced_tokens and not s.seq.params.per_token
                for s in samplers):
            greedy = self.runner.greedy(logits)
            cuda = self.device.type == "cuda"
            host = torch.empty(greedy.shape, dtype=torch.int64, pin_memory=cuda)
            host.copy_(greedy, non_blocking=cuda)
            ready = torch.cuda.Event() if cuda else None
            if ready is not None:
                ready.record()
            launched = _Launched(batch, starts, None, host, ready)
        else:
            launched = _Launched(batch, starts, self._host_tokens(samplers, logits), None, None)
        self.stats.forward_seconds += time.perf_counter() - t0
        return launched

    def _host_tokens(self, samplers: list[ScheduledSequence], logits: torch.Tensor) -> list[list[int]]:
        """Per sampling row, its tokens: one sampled (or forced) token, or a draft's verified tokens
        (engine/sched/speculation.py). The logits sink sees the logits of each emitted token's position."""
        offsets = list(itertools.accumulate((1 + len(s.draft) for s in samplers), initial=0))
        out: list[list[int]] = [[] for _ in samplers]
        plain = [i for i, s in enumerate(samplers) if not s.draft]
        if plain:
            rows = logits if len(plain) == logits.shape[0] else logits[
                torch.tensor([offsets[i] for i in plain], device=logits.device)]
            seqs = [samplers[i].seq for i in plain]
            bound = [(j, self._constraints[s.request_id]) for j, s in enumerate(seqs) if s.request_id in self._constraints]
            model_rows = rows  # what log-probabilities and the logits sink report: the model's own
            if bound:  # the grammar's forbidden tokens out, on a copy
                rows = rows.clone()
                for j, c in bound:
                    c.mask_(rows[j])
            tokens = sample(rows, [s.params for s in seqs], [self._generators.get(s.request_id) for s in seqs],
                            [len(s.output_token_ids) for s in seqs],
                            [(s.prompt_token_ids, s.output_token_ids) for s in seqs])
            for j, c in bound:
                if not c.advance(tokens[j]):  # a forced token, or past the end with ignore_eos: unconstrained now
                    self._constraints.pop(seqs[j].request_id, None)
            for j, (i, tok) in enumerate(zip(plain, tokens)):
                out[i] = [tok]
                k = seqs[j].params.logprobs
                if k is not None:  # of the model's own distribution (before penalties and temperature), as vLLM's
                    seqs[j].logprobs.append((tok, *top_logprobs(model_rows[j], tok, k)))
        for i, item in enumerate(samplers):
            if item.draft:
                rows, params = logits[offsets[i]:offsets[i + 1]], item.seq.params
                out[i] = self._until_stop(item.seq, speculation.accept_greedy(
                    list(item.draft), rows.argmax(dim=-1).tolist()) if params.greedy else speculation.accept_sampled(
                    rows, list(item.draft), params, self._generators.get(item.seq.request_id)))
        if self.logits_sink is not None and samplers:
            ids = [s.seq.request_id for s, toks in zip(samplers, out) for _ in toks]
            idx = [offsets[i] + j for i, toks in enumerate(out) for j in range(len(toks))]
            self.logits_sink(ids, logits if len(idx) == logits.shape[0] else logits[
                torch.tensor(idx, device=logits.device)])
        return out

    def _live(self, launched: _Launched) -> list[bool]:
        """Per row: its sequence still runs from where the step expects (not stopped, aborted or preempted)."""
        return [item.seq.status is SequenceStatus.RUNNING and item.seq.finish_reason is None
                and item.seq.num_computed_tokens == start
                for item, start in zip(launched.batch.scheduled, launched.starts)]

    def _can_run_ahead(self, launched: _Launched) -> bool:
        """Whether the next step can be launched before this one's tokens are read: a greedy decode of
        every running sequence, nothing waiting for admission, and a KV slot for each next token."""
        rows = launched.batch.scheduled
        if (not self.config.run_ahead or launched.tokens is not None or not all(self._live(launched))
                or not self.scheduler.continues(rows)):
            return False
        if any(start + 2 > self.max_model_len for start in launched.starts):
            return False
        return all(self.block_manager.ensure_slots(item.seq, start + 2) for item, start in zip(rows, launched.starts))

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        """Reads the step's tokens (waiting for the device if needed) and postprocesses its live rows."""
        samplers = [item for item in launched.batch.scheduled if item.samples]
        tokens = launched.tokens
        if tokens is None:
            if launched.ready is not None:
                launched.ready.synchronize()
            flat, tokens, at = launched.host_tokens.tolist(), [], 0
            for item in samplers:  # greedy: a draft's rows verified against their argmax
                rows, at = flat[at:at + 1 + len(item.draft)], at + 1 + len(item.draft)
                tokens.append(speculation.accept_greedy(list(item.draft), rows) if item.draft else rows)
        new_tokens = {item.seq.request_id: toks for item, toks in zip(samplers, tokens)}
        live = self._live(launched)
        batch = launched.batch
        if not all(live):
            batch = SchedulerOutput([item for item, ok in zip(batch.scheduled, live) if ok], batch.preempted)
        return self._postprocess(batch, new_tokens)

    def drain(self) -> None:
        """Collects a step launched ahead, keeping its outputs for the next ``step``."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._drained.extend(self._collect(launched))
        self.runner.greedy_tokens = None

    def _postprocess(self, batch: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[RequestOutput]:
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        before = [len(item.seq.output_token_ids) for item in batch.scheduled]
        self.scheduler.update(batch, new_tokens, self._check_stop)
        outputs = []
        for item, n in zip(batch.scheduled, before):
            seq = item.seq
            self.stats.tokens_computed += item.num_new_tokens
            if item.samples:
                emitted = len(seq.output_token_ids) - n  # a stop token ends a verified draft's tokens early
                self.stats.generation_tokens += emitted
                if item.draft:
                    self._record_draft(item, emitted - 1)
                if seq.first_token_time is None:
                    seq.first_token_time = time.perf_counter()
            if seq.finish_reason is not None:
                self._seqs.pop(seq.request_id, None)
                self._generators.pop(seq.request_id, None)
                self._constraints.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _until_stop(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """A verified draft's tokens up to the first stop token: those after it are never emitted, so the
        logits sink does not see them."""
        return next((tokens[:i + 1] for i, tok in enumerate(tokens) if self._stops_at(seq, tok)), tokens)

    def _stops_at(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        return (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids

    def _record_draft(self, item: ScheduledSequence, accepted: int) -> None:
        """Speculation's counters, and the request's adaptive draft length and acceptance."""
        proposed, st = len(item.draft), self.stats
        st.spec_drafts += 1
        st.spec_draft_tokens += proposed
        st.spec_accepted_tokens += accepted
        if len(st.spec_accepted_per_pos) < proposed:
            st.spec_accepted_per_pos.extend([0] * (proposed - len(st.spec_accepted_per_pos)))
        for pos in range(accepted):
            st.spec_accepted_per_pos[pos] += 1
        seq, v = item.seq, self.variant
        if seq.spec is not None:
            seq.spec.record(proposed, accepted, v.speculative_tokens, v.speculative_min_acceptance,
                            len(seq.output_token_ids))

    def _check_stop(self, seq: Sequence) -> None:
        p = seq.params
        if self._stops_at(seq, seq.output_token_ids[-1]):
            seq.finish_reason = FinishReason.STOP
        elif p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                seq.output_text = text[:cut]
                seq.finish_reason = FinishReason.STOP
        if seq.finish_reason is None and len(seq.output_token_ids) >= p.max_tokens:
            seq.finish_reason = FinishReason.LENGTH

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.finish_reason is not None
        text = seq.output_text
        if finished and not text and self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason is FinishReason.STOP and ids and ids[-1] in self.eos_token_ids:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids)
            seq.output_text = text
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason.value if finished else None,
            num_cached_tokens=seq.num_cached_tokens,
            num_tokens_run=seq.num_tokens_run,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        )

    # ---- variants (engine/core/variant_swap.py) --------------------------------------------------------
    def prepare_variant(self, spec: VariantSpec, kv: KVCache | None = None) -> PreparedVariant:
        return variant_swap.prepare(variant_swap.context(self), spec, kv)

    def apply_variant(self, spec: VariantSpec, prepared: PreparedVariant | None = None) -> SwapReport:
        return variant_swap.apply(self, spec, prepared)

    def swap_variant(self, spec: VariantSpec) -> SwapReport:
        return variant_swap.swap(self, spec)

    def rollback(self) -> SwapReport:
        return variant_swap.rollback(self)

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion together (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
