"""The OpenAI API's request bodies as the server reads them (pydantic models), and its error.

Unknown fields are allowed here (``extra="allow"``) so that the server can ignore them and log their names
once (engine/entrypoints/server.py); a known field with a value the server cannot honour is refused there.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


MAX_N = 16  # choices per request


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: ignored and logged once (build_app)
    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None  # the completions API: how many of the most likely tokens, with the chosen one


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    # a string, or content parts: [{"type": "text", "text": ...}, ...]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (engine/worker/structured.py)
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def message_text(m: ChatMessage) -> dict:
    """A message as the chat template takes it: content parts joined into one string (text parts only)."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"only text content parts are supported, got {str(part.get('type'))[:40]!r}",
                               param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    out = {"role": m.role, "content": content or ""}
    if m.name is not None:
        out["name"] = m.name
    return out
