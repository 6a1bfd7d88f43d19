"""The LLM agent: asks any OpenAI-compatible server for proposals as JSON and treats every reply as hostile.

A reply must match REPLY_SCHEMA (what may change is generated from VariantSpec's fields); kernel source must
pass the generated-kernel grammar (engine/generated/grammar.py) before it is even queued. A reply that is not
what was asked is recorded on the board as ``invalid_reply`` with the reason, and the search goes on. The
API key is never posted to the board, logged or sent anywhere but the server.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from engine.errors import ConfigError, VariantError
from engine.generated.isolation import redact
from engine.generated.grammar import check_kernel
from engine.config.variant import VariantSpec
from kernels.generated.launch import GENERATED_OPS, SIGNATURES
from ops.search.agents import Agent, Proposal, SearchState, fast_score
from ops.search.board import Board


_CHANGE_PROPS = VariantSpec.change_schema()  # the one definition of what a proposal may change
REPLY_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["proposals"],
    "properties": {"proposals": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
        "type": "object", "additionalProperties": False, "required": ["rationale", "changes"],
        "properties": {
            "rationale": {"type": "string", "minLength": 1, "maxLength": 2000},
            "changes": {"type": "object", "additionalProperties": False, "properties": _CHANGE_PROPS},
            "kernel_source": {"type": "object", "additionalProperties": False,
                              "required": ["op", "module", "function", "source"],
                              "properties": {"op": {"enum": list(GENERATED_OPS)},
                                             "module": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                             "function": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                             "source": {"type": "string", "minLength": 1, "maxLength": 20000}}},
        }}}},
}


class InvalidReply(ValueError):
    pass


def _extract_json(text: str):
    """The JSON object in a reply: the whole text, a fenced block, or the outermost braces."""
    text = text.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    candidates = [text] + ([fenced.group(1)] if fenced else [])
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{"): text.rindex("}") + 1])
    last = None
    for c in candidates:
        try:
            return json.loads(c)
        except json.JSONDecodeError as e:
            last = e
    raise InvalidReply(f"not JSON: {last}")


def parse_reply(text: str | None, base: VariantSpec, agent: str = "llm") -> list[Proposal]:
    """Validates a reply against REPLY_SCHEMA and turns each proposal into a VariantSpec over ``base``.
    Raises InvalidReply naming the first problem."""
    import jsonschema

    if not text or not text.strip():
        raise InvalidReply("empty reply")
    data = _extract_json(text)
    try:
        jsonschema.validate(data, REPLY_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise InvalidReply(f"does not match the schema at {where}: {e.message[:300]}") from None
    out = []
    for i, p in enumerate(data["proposals"]):
        changes = dict(p["changes"])
        if "cuda_graph_batch_sizes" in changes:
            changes["cuda_graph_batch_sizes"] = tuple(changes["cuda_graph_batch_sizes"])
        if "kernels" in changes:
            changes["kernels"] = {**dict(base.kernels), **changes["kernels"]}
        if "kernel_params" in changes:
            changes["kernel_params"] = {**{op: dict(v) for op, v in base.kernel_params}, **changes["kernel_params"]}
        src = p.get("kernel_source")
        if src:
            try:
                check_kernel(src["op"], src["module"], src["function"], src["source"])
            except VariantError as e:
                raise InvalidReply(f"proposal {i}: kernel source refused: {e}") from None
            changes["generated_source"] = {**dict(base.generated_source), src["module"]: src["source"]}
            changes["kernels"] = {**dict(changes.get("kernels", base.kernels)),
                                  src["op"]: f"generated:{src['module']}.{src['function']}"}
        try:
            v = dataclasses.replace(base, name=f"{agent}: {p['rationale'][:40]}", **changes)
        except (ConfigError, TypeError) as e:
            raise InvalidReply(f"proposal {i}: not a valid variant: {e}") from None
        out.append(Proposal(v, p["rationale"]))
    return out


def _reply_text(reply) -> str:
    """The first choice's message text of a chat-completion reply; InvalidReply when the server's answer has no
    such text (no choices, a choice without a message, content that is not a string)."""
    try:
        text = reply.choices[0].message.content
    except (AttributeError, IndexError, KeyError, TypeError):
        raise InvalidReply("the server's reply has no choices[0].message.content") from None
    if not isinstance(text, str):
        raise InvalidReply(f"the reply's content is {type(text).__name__}, not text")
    return text


def kernel_grammar_brief() -> str:
    """What an LLM needs to write a generated kernel: the grammar's rules and each operation's signature."""
    from engine.generated import grammar as kernel_grammar
    rules = kernel_grammar.__doc__.split("\n\n")[1]
    sigs = "\n".join(
        f"- {op}: def <function>({', '.join(p + (': tl.constexpr' if p in s.constexprs else '') for p in s.params)})"
        f"; grid {s.grid}; {s.doc}; tiles {', '.join(s.tiles)} (powers of two) and num_warps"
        for op, s in SIGNATURES.items())
    return f"{rules}\nOperations and their kernel signatures:\n{sigs}"


@dataclass
class LLMAgent(Agent):
    """Asks an OpenAI-compatible server (``base_url``, ``model``, ``api_key`` from configuration) for
    proposals as JSON. Replies are validated; invalid ones go on the board and yield nothing."""

    base_url: str
    model: str
    api_key: str = field(default="none", repr=False)
    board: Board | None = None
    timeout_s: float = 120.0
    max_tokens: int = 512
    name: str = "llm"
    replies: int = 0
    invalid: int = 0

    def messages(self, state: SearchState, n: int) -> list[dict]:
        rows = sorted(state.fast, key=lambda rv: fast_score(rv[0].bench), reverse=True)[:8]
        measured = [{"result_id": r.id, "variant": {k: v.to_json()[k] for k in (
            "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "block_size", "enable_prefix_caching",
            "cuda_graph_batch_sizes", "kernels")}, "implied_capacity_req_s": fast_score(r.bench)[0],
            "implied_output_tok_s": round(fast_score(r.bench)[2], 2)} for r, v in rows]
        context = {
            "model": {k: getattr(state.model_spec, k) for k in ("architecture", "layers", "hidden_size", "heads",
                                                          "kv_heads", "dtype", "param_bytes")},
            "hardware": {"device": state.hardware.device, "memory_bandwidth_GBps": state.hardware.memory_bandwidth / 1e9},
            "traffic": {k: round(v, 3) if isinstance(v, float) else v for k, v in state.traffic.to_json().items()},
            "baseline": {k: state.baseline.to_json()[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                  "prefill_chunk_size", "block_size",
                                                                  "enable_prefix_caching")},
            "cost_model_ranges": state.plan.ranges,
            "measured": measured,
        }
        system = ("You tune an LLM inference engine for the traffic it serves. Reply with one JSON object and "
                  "nothing else, matching this JSON schema:\n" + json.dumps(REPLY_SCHEMA) +
                  "\n'changes' lists only the fields to change from the baseline. kernel_source is optional: "
                  "one Triton kernel for one operation, in the grammar below, launched by the engine's own "
                  "wrapper; its tiles go in kernel_params[op].\n" + kernel_grammar_brief())
        user = (f"Propose up to {n} variants likely to raise the capacity at the SLO (req/s), then output tokens/s.\n"
                + json.dumps(context))
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def propose(self, state: SearchState, n: int) -> list[Proposal]:
        from openai import BadRequestError, OpenAI, OpenAIError

        self._search = state.search_id
        client = OpenAI(base_url=self.base_url, api_key=self.api_key or "none", timeout=self.timeout_s, max_retries=0)
        text = None
        try:
            ask = dict(model=self.model, messages=self.messages(state, n), temperature=0, max_tokens=self.max_tokens)
            try:
                reply = client.chat.completions.create(**ask, response_format={
                    "type": "json_schema", "json_schema": {"name": "variant_proposals", "schema": REPLY_SCHEMA}})
            except BadRequestError as e:
                if "response_format" not in str(e):
                    raise
                # a server without structured outputs (ours refuses the field rather than ignore it): ask again
                # without it; the reply is validated against the schema either way
                reply = client.chat.completions.create(**ask)
            self.replies += 1
            text = _reply_text(reply)
            proposals = parse_reply(text, state.baseline, self.name)
        except InvalidReply as e:
            self.invalid += 1
            self._record("invalid_reply", {"reason": str(e), "reply": (text or "")[:4000]})
            return []
        except OpenAIError as e:
            self._record("note", {"error": f"the LLM server failed: {type(e).__name__}: {str(e)[:500]}"})
            return []
        self._record("note", {"valid_reply": len(proposals)})
        return [p for p in proposals if state.fresh(p.variant)][:n]

    def _record(self, kind: str, body: dict) -> None:
        """Posts to the board, the API key redacted from everything posted (a server's error may quote it)."""
        if self.board is not None:
            body = {k: redact(v, [self.api_key]) if isinstance(v, str) else v for k, v in body.items()}
            self.board.post(self.name, kind, {"search": getattr(self, "_search", None), "model": self.model,
                                              "base_url": self.base_url, **body})
