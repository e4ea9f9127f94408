"""An OpenAI request -> a Job. The request bodies are pydantic models of OpenAI's schema
(`ChatRequest`, `CompletionRequest`: types, ranges, unknown fields refused, all in the server's
OpenAPI schema); then what depends on the server (its limits, its drafts, the target's vocabulary
and context) is checked against what it serves. Each refusal is a 400 naming the field and the
fix; the speculation knobs resolve into DecodeSettings."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from assets.chat import render
from recipe import ConfigError, DecodeSettings
from serving.served import Served

MAX_STOP_CHARS = 256
"""The longest stop string: each is searched in the text after every decoded token."""
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0,
           "logit_bias": {}}
"""Fields OpenAI clients send that this server does not implement: taken at these values (or
absent, or null: a no-op), refused by name at any other."""

Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
NonNegative = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    """A string, or OpenAI's array of text parts (joined)."""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    """The fields both endpoints take. Bounds that depend on the server (max_tokens, top_k,
    max_speculative_tokens) are checked against it after these."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: NonNegative | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # speculation, this server's own fields
    speculative_decoding: bool | None = None
    """Off: plain decoding. Default: on when a draft is named or the server has a trained one."""
    draft_model: str | None = None
    max_speculative_tokens: NonNegative | None = None
    # OpenAI's, not implemented here: accepted at their neutral values only (NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegative | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = None
    """A no-op whatever its value: this server takes no tools."""

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """OpenAI's newer name for max_tokens; it wins when both are given."""


class CompletionRequest(_Request):
    prompt: Annotated[str, StringConstraints(min_length=1)] | Annotated[
        list[NonNegative], Field(min_length=1)]
    """A text, or token ids of the target's vocabulary."""
    return_token_ids: bool = False
    """Answer with the generated token ids too (vLLM's extension, what stage 1 reads)."""
    stop_token_ids: list[int] | None = None
    """vLLM's; only the target's own end-of-turn ids are taken."""


HINTS = {
    "messages": "a non-empty list of {role, content} objects with string content (or an array "
                "of {\"type\": \"text\", \"text\": ...} parts: this server reads text alone)",
    "prompt": "a non-empty string or a list of token ids",
    "stop": f"a string of 1 to {MAX_STOP_CHARS} characters or a list of at most 4 such",
}
"""What a field of several shapes must be, said once instead of each shape's own error."""


@dataclass
class Limits:
    max_queue: int = 64
    """Requests waiting or running; one more is answered 429."""
    max_batch: int = 8
    """Greedy requests decoded together."""
    max_tokens: int = 1024
    """The largest max_tokens a request may ask for."""
    max_speculative_tokens: int = 16
    max_body_bytes: int = 1 << 20
    batch_wait_ms: float = 5.0
    """How long the scheduler waits for more requests to join a batch."""

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_batch < 1 or self.max_tokens < 1:
            raise ConfigError("--max-queue, --max-batch and --max-tokens must be >= 1.")
        if not 0 <= self.max_speculative_tokens <= 64:
            raise ConfigError("--max-speculative-tokens must be in [0, 64].")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


@dataclass
class Job:
    """One request on its way through the scheduler; events go to its asyncio queue."""

    prompt: list[int]
    settings: DecodeSettings
    draft: str | None
    """A loaded draft's name, or None for plain decoding."""
    seed: int | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    first_token_at: float = 0.0
    tokens: list[int] = field(default_factory=list)
    text_sent: int = 0
    cancelled: bool = False
    finished: bool = False
    return_token_ids: bool = False
    """Answer with the generated token ids too (vLLM's extension, what stage 1 reads)."""

    def batch_key(self):
        """Requests with equal keys may share a batch: greedy, same draft and k."""
        if self.settings.temperature > 0:
            return None
        s = self.settings
        return (self.draft, s.k, s.adaptive_k, s.k_max)


RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def refusal(error: ValidationError, model: type[_Request]) -> HTTPError:
    """pydantic's errors for a body -> one 400 naming the field and what it must be."""
    errors = error.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in errors
                     if e["type"] == "extra_forbidden" and len(e["loc"]) == 1)
    if unknown:
        return HTTPError(400, f"unknown field(s) {unknown}: this server takes "
                              f"{sorted(model.model_fields)}.")
    first = errors[0]
    if not first["loc"]:
        return HTTPError(400, "the request body must be a JSON object.")
    name, got = str(first["loc"][0]), repr(first["input"])
    got = got if len(got) <= 80 else got[:77] + "..."
    if name in HINTS:
        return HTTPError(400, f"'{name}' must be {HINTS[name]} ({first['msg'].lower()}).")
    if first["type"] in RANGE_ERRORS:
        return HTTPError(400, f"'{name}'={got} is outside the range it takes "
                              f"({first['msg'].lower()}).")
    return HTTPError(400, f"'{name}': {first['msg'].lower()}, got {got}.")


def read_job(body, chat: bool, served: Served, limits: Limits,
             loop: asyncio.AbstractEventLoop) -> tuple[Job, _Request]:
    """A request's JSON -> (the job, the request it came from). HTTPError(4xx) on any bad field,
    naming it and the fix."""
    model = ChatRequest if chat else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise refusal(e, model) from None
    return to_job(request, served, limits, loop), request


def to_job(request: _Request, served: Served, limits: Limits,
           loop: asyncio.AbstractEventLoop) -> Job:
    """A well-formed request -> a Job, checked against what this server serves."""
    if request.model not in (None, served.model_id):
        raise HTTPError(404, f"model {request.model!r} is not served here: use "
                             f"{served.model_id!r} (GET /v1/models).", "not_found_error")
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name)
        if value is not None and value != neutral:
            raise HTTPError(400, f"'{name}'={value!r} is not implemented here: the server "
                                 "returns the target's own distribution, sampled as asked; "
                                 f"leave it out or at {neutral!r}.")
    prompt = _prompt(request, served.tokenizer)
    limit = getattr(request, "max_completion_tokens", None)
    max_tokens = _within("max_completion_tokens" if limit is not None else "max_tokens",
                         limit if limit is not None else request.max_tokens, 1, limits.max_tokens,
                         min(served.decoding.max_new_tokens, limits.max_tokens))
    top_k = _within("top_k", request.top_k, 0, len(served.tokenizer), 0)
    stop_ids = getattr(request, "stop_token_ids", None) or []
    if not set(stop_ids) <= served.eos:
        raise HTTPError(400, f"'stop_token_ids' {stop_ids!r}: this server stops at the target's "
                             f"end-of-turn tokens {sorted(served.eos)} only; name some of those "
                             "or leave the field out.")
    name, k = _draft_and_k(request, served, limits)
    settings = _settings(served.decoding, max_tokens, request, top_k, k)
    depth = k if name else 0
    if served.context is not None and len(prompt) + max_tokens + depth > served.context:
        raise HTTPError(400, f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + "
                             f"{depth} draft positions exceed the model's context of "
                             f"{served.context}: shorten the prompt or lower max_tokens.")
    return Job(prompt, settings, name, request.seed, request.stops(), loop, asyncio.Queue(),
               return_token_ids=getattr(request, "return_token_ids", False))


def _within(name: str, value: int | None, low: int, high: int, default: int) -> int:
    """A bound that depends on the server (its limits, the target's vocabulary)."""
    if value is None:
        return default
    if not low <= value <= high:
        raise HTTPError(400, f"'{name}'={value} is outside [{low}, {high}] on this server.")
    return value


def _settings(base: DecodeSettings, max_tokens: int, request: _Request, top_k: int,
              k: int) -> DecodeSettings:
    """The server's decoding settings with the request's sampling and k."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    try:
        settings = replace(base, max_new_tokens=max_tokens, temperature=temperature,
                           top_p=top_p if temperature > 0 else 1.0,
                           top_k=top_k if temperature > 0 else 0, k=max(k, 1),
                           k_max=max(k, 1), adaptive_k=base.adaptive_k and k > 1,
                           draft_temperature=None)
        if settings.adaptive_k:
            settings = replace(settings, k=min(base.k, k))
    except ConfigError as e:
        raise HTTPError(400, str(e)) from None
    return settings


def _prompt(request: _Request, tokenizer) -> list[int]:
    """The request's prompt as token ids: chat messages rendered in the target's template, a
    completion's text tokenized, or its token ids checked against the vocabulary."""
    if isinstance(request, ChatRequest):
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            return render(tokenizer, messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template refused these messages
            raise HTTPError(400, f"the target's chat template cannot render these messages "
                                 f"({type(e).__name__}: {e}); check their roles and "
                                 "order.") from None
    if isinstance(request.prompt, str):
        return tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
    if max(request.prompt) >= len(tokenizer):
        raise HTTPError(400, f"'prompt' holds token ids outside [0, {len(tokenizer)}).")
    return list(request.prompt)


def _draft_and_k(request: _Request, served: Served, limits: Limits) -> tuple[str | None, int]:
    """The draft a request speculates with (None: plain decoding) and its k."""
    name = request.draft_model
    speculate = request.speculative_decoding
    if speculate is None:  # on when a draft is named or the server has a trained one
        speculate = name is not None or served.default_draft is not None
    if name is not None and name not in served.drafts:
        raise HTTPError(400, f"draft_model {name[:80]!r} is not loaded: choose one of "
                             f"{sorted(served.drafts)} (start the server with --draft "
                             f"NAME=FOLDER to add it).")
    if speculate and name is None:
        name = served.default_draft
        if name is None:
            raise HTTPError(400, "speculative_decoding is on but this server has no trained "
                                 "draft: name draft_model='ngram', or start it with --draft.")
    default_k = min(served.decoding.k_max_used, limits.max_speculative_tokens)
    k = _within("max_speculative_tokens", request.max_speculative_tokens, 0,
                limits.max_speculative_tokens, default_k)
    if not speculate or k == 0:
        name, k = None, 0
    loaded = served.drafts.get(name) if name else None
    if loaded is not None and loaded.max_k is not None and k > loaded.max_k:
        raise HTTPError(400, f"max_speculative_tokens={k}, but draft {name!r} has {loaded.max_k}"
                             f" {loaded.max_k_unit}: ask for at most {loaded.max_k}.")
    return name, k
