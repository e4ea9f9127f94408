"""An OpenAI request -> a Job: every field checked against the server's limits and what it
serves (a 400 naming the field otherwise), the speculation knobs resolved into DecodeSettings."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from assets.chat import render
from recipe import ConfigError, DecodeSettings
from serving.served import Served

KNOBS = {"speculative_decoding", "draft_model", "max_speculative_tokens"}
MAX_STOP_CHARS = 256
"""The longest stop string: each is searched in the text after every decoded token."""
COMMON = {"model", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n", "stream",
          "stream_options", "user"} | KNOBS
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
           "top_logprobs": 0, "logit_bias": None, "parallel_tool_calls": None}
"""Fields OpenAI clients send that this server does not implement: taken at these values (a
no-op), refused by name at any other."""
COMMON |= set(NEUTRAL)
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt", "return_token_ids", "stop_token_ids"}  # vLLM's own


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


def _number(body: dict, name: str, kind, low, high, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not float(value).is_integer()):
        raise HTTPError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}.")
    if not low <= value <= high:
        raise HTTPError(400, f"'{name}'={value} is outside [{low}, {high}].")
    return kind(value)


def parse_job(body, chat: bool, served: Served, limits: Limits,
              loop: asyncio.AbstractEventLoop) -> tuple[Job, bool, dict]:
    """A request's JSON -> (the job, stream, what the response echoes). HTTPError(4xx) on any
    bad field, naming it and the fix."""
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object.")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}: this server takes {sorted(allowed)}.")
    if body.get("model") not in (None, served.model_id):
        raise HTTPError(404, f"model {body.get('model')!r} is not served here: use "
                             f"{served.model_id!r} (GET /v1/models).", "not_found_error")
    if _number(body, "n", int, 1, 1, 1) != 1:
        raise HTTPError(400, "'n' must be 1.")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise HTTPError(400, f"'{name}'={body[name]!r} is not implemented here: the server "
                                 "returns the target's own distribution, sampled as asked; "
                                 f"leave it out or at {neutral!r}.")
    tokenizer = served.tokenizer
    prompt = _prompt(body, chat, tokenizer)
    max_tokens = _number(body, "max_completion_tokens" if "max_completion_tokens" in body
                         else "max_tokens", int, 1, limits.max_tokens,
                         min(served.decoding.max_new_tokens, limits.max_tokens))
    temperature = _number(body, "temperature", float, 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", float, 1e-6, 1.0, 1.0)
    top_k = _number(body, "top_k", int, 0, len(tokenizer), 0)
    seed = _number(body, "seed", int, -(2 ** 63), 2 ** 63 - 1, None)
    stops = body.get("stop") or []
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or len(stops) > 4 or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise HTTPError(400, f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a "
                             "list of at most 4 such.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be true or false.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise HTTPError(400, "'stream_options' takes only {\"include_usage\": bool}.")

    return_ids = body.get("return_token_ids") or False
    if not isinstance(return_ids, bool):
        raise HTTPError(400, "'return_token_ids' must be true or false.")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids) or (
            not set(stop_ids) <= served.eos):
        raise HTTPError(400, f"'stop_token_ids' {stop_ids!r}: this server stops at the target's "
                             f"end-of-turn tokens {sorted(served.eos)} only; name some of those "
                             "or leave the field out.")

    name, k = _draft_and_k(body, served, limits)
    base = served.decoding
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
    depth = k if name else 0
    if served.context is not None and len(prompt) + max_tokens + depth > served.context:
        raise HTTPError(400, f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) + "
                             f"{depth} draft positions exceed the model's context of "
                             f"{served.context}: shorten the prompt or lower max_tokens.")
    job = Job(prompt, settings, name, seed, stops, loop, asyncio.Queue(),
              return_token_ids=return_ids)
    return job, stream, {"include_usage": bool(options.get("include_usage"))}


def _prompt(body: dict, chat: bool, tokenizer) -> list[int]:
    """The request's prompt as token ids: chat messages rendered in the target's template, a
    completion's text tokenized, or its token ids checked against the vocabulary."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise HTTPError(400, "'messages' must be a non-empty list of {role, content} objects "
                                 "with string content.")
        messages = [{"role": m["role"], "content": _content(m.get("content"))} for m in messages]
        try:
            prompt = render(tokenizer, [{"role": m["role"], "content": m["content"]}
                                        for m in messages], add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template refused these messages
            raise HTTPError(400, f"the target's chat template cannot render these messages "
                                 f"({type(e).__name__}: {e}); check their roles and "
                                 "order.") from None
    else:
        text = body.get("prompt")
        if isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in text):
            prompt = list(text)
            if max(prompt) >= len(tokenizer) or min(prompt) < 0:
                raise HTTPError(400, f"'prompt' holds token ids outside [0, {len(tokenizer)}).")
        elif isinstance(text, str) and text:
            prompt = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            raise HTTPError(400, "'prompt' must be a non-empty string or a list of token ids.")
    return prompt


def _content(content) -> str:
    """A message's content: a string, or OpenAI's array of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise HTTPError(400, "'messages' must be a non-empty list of {role, content} objects with "
                         "string content (or an array of {\"type\": \"text\", \"text\": ...} "
                         "parts: this server reads text alone).")


def _draft_and_k(body: dict, served: Served, limits: Limits) -> tuple[str | None, int]:
    """The draft a request speculates with (None: plain decoding) and its k."""
    name = body.get("draft_model")
    # on when a draft is named or the server has a trained one, unless the request says off
    speculate = body.get("speculative_decoding",
                         name is not None or served.default_draft is not None)
    if not isinstance(speculate, bool):
        raise HTTPError(400, "'speculative_decoding' must be true or false.")
    if name is not None and not isinstance(name, str):
        raise HTTPError(400, f"'draft_model' must be a draft's name (one of "
                             f"{sorted(served.drafts)}), got {str(name)[:80]!r}.")
    if name is not None and name not in served.drafts:
        raise HTTPError(400, f"draft_model {name!r} is not loaded: choose one of "
                             f"{sorted(served.drafts)} (start the server with --draft "
                             f"{name}=FOLDER to add it).")
    if speculate and name is None:
        name = served.default_draft
        if name is None:
            raise HTTPError(400, "speculative_decoding is on but this server has no trained "
                                 "draft: name draft_model='ngram', or start it with --draft.")
    default_k = min(served.decoding.k_max_used, limits.max_speculative_tokens)
    k = _number(body, "max_speculative_tokens", int, 0, limits.max_speculative_tokens,
                default_k)
    if not speculate or k == 0:
        name, k = None, 0
    loaded = served.drafts.get(name) if name else None
    if loaded is not None and loaded.max_k is not None and k > loaded.max_k:
        raise HTTPError(400, f"max_speculative_tokens={k}, but draft {name!r} has {loaded.max_k}"
                             f" {loaded.max_k_unit}: ask for at most {loaded.max_k}.")
    return name, k
