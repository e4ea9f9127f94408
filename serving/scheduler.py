"""The scheduler: a bounded queue, static batches of greedy requests with the same draft and k,
sampled requests alone, one decoding thread over decoding.engine.generate; and the Prometheus
metrics it keeps."""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from dataclasses import replace

import torch

from decoding.engine import RequestStats, generate, left_pad
from drafts import engine_draft
from serving.request import Job, Limits
from serving.served import Served


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

    @property
    def alive(self) -> bool:
        """Whether the decoding thread still runs."""
        return self._thread.is_alive()

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
                                  "completion_tokens": len(job.tokens),
                                  "token_ids": list(job.tokens), **speculation}))
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
