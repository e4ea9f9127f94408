"""Stage 1 against running OpenAI-compatible servers (generation.backend: openai): a vLLM or
SGLang deployment with its own tensor/data parallelism and nodes, or serving.server.

Each reply is one POST /v1/completions with the prompt as token ids, the conversation turn's
seed, and vLLM's extensions stop_token_ids (the target's end-of-turn ids) and
return_token_ids (the ids the target wrote; without them the text is re-tokenized and checked).
Requests run openai_concurrency at a time per endpoint, each sent to the least busy one; a 429,
a 5xx, a timeout or a dropped connection is retried (on the next endpoint, after 1, 2, 4 .. 60 s
or the server's Retry-After) up to openai_max_retries times, then stage 1 stops, keeping every
whole batch written (a resume generates the rest).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from assets.chat import encode
from decoding.hf import Reply
from recipe import ConfigError, GenerationConfig

RETRIED = {408, 409, 425, 429, 500, 502, 503, 504}
"""HTTP statuses worth another try: the server is busy, restarting or overloaded."""


class EndpointError(ConfigError):
    """A server that cannot, or will not, answer: stage 1 stops, keeping what is written."""


@dataclass
class RemoteStats:
    """What the servers did for this process, for the log and the mismatch check."""

    replies: int = 0
    with_token_ids: int = 0
    retokenized_mismatches: int = 0
    retries: int = 0
    no_finish_reason: int = 0


MAX_RETRY_AFTER_S = 120.0
"""The longest wait a server's Retry-After gets: a longer one (or one in days) would stall
stage 1, so it is cut to this and the retry counts as one of generation.openai_max_retries."""


def checked_choice(answer, vocab_size: int, endpoint: str) -> dict:
    """A completion reply's first choice, refused (EndpointError, naming the server) where it is
    not a completion: no choices, a choice that is not an object, token ids that are not
    integers of the target's vocabulary, or neither token ids nor text. What stage 1 already
    wrote stays."""
    def refuse(problem: str) -> EndpointError:
        return EndpointError(f"{endpoint} answered a completion with {problem}: it does not "
                             "serve this target as an OpenAI-compatible completion endpoint "
                             "(check generation.openai_endpoints and openai_model). Every whole "
                             "batch written is kept.")

    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices:
        raise refuse("no choices")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise refuse(f"a choice that is not an object ({str(choice)[:80]!r})")
    ids = choice.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in ids)):
        raise refuse(f"token ids outside the target's vocabulary of {vocab_size} "
                     f"({str(ids)[:80]})")
    if ids is None and not isinstance(choice.get("text"), str):
        raise refuse("neither token_ids nor text")
    return choice


class OpenAIGenerator:
    """The target behind OpenAI-compatible endpoints: replies(prompts, seeds) like the local
    backends, the requests of a batch concurrent."""

    def __init__(self, gen: GenerationConfig, tokenizer, eos_ids: set[int], names: list[str]):
        import httpx

        self.gen, self.tokenizer, self.eos_ids = gen, tokenizer, eos_ids
        self.endpoints = [u.rstrip("/") for u in gen.openai_endpoints]
        key = os.environ.get(gen.openai_api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=gen.openai_concurrency * len(self.endpoints))
        self.client = httpx.Client(headers=headers, timeout=gen.openai_timeout_s, limits=limits)
        self.in_flight = [0] * len(self.endpoints)
        self.slots = [threading.BoundedSemaphore(gen.openai_concurrency) for _ in self.endpoints]
        self.lock = threading.Lock()
        self.stats = RemoteStats()
        self.pool = ThreadPoolExecutor(gen.openai_concurrency * len(self.endpoints),
                                       thread_name_prefix="openai")
        self.model = None  # no local weights (top-k log-probs are refused at config load)
        self.served_names = [self._served_name(i, names) for i in range(len(self.endpoints))]

    def _served_name(self, i: int, names: list[str]) -> str:
        """The target's name on endpoint i (GET /models); an endpoint that does not serve it
        is refused."""
        body = self._request(i, "GET", "/models", None, f"GET {self.endpoints[i]}/models",
                             rotate=False)
        served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        found = next((name for name in names if name in served), None)
        if found is None:
            raise EndpointError(
                f"{self.endpoints[i]} serves {served}, not the target (as any of {names}): "
                "point generation.openai_endpoints at servers of the target, or set "
                "generation.openai_model to its served name (vllm serve --served-model-name). "
                "Nothing was generated.")
        return found

    def replies(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        return list(self.pool.map(self._reply, prompts, seeds))

    def _reply(self, prompt: list[int], seed: int) -> Reply:
        gen = self.gen
        body = {"prompt": prompt, "max_tokens": gen.max_new_tokens,
                "temperature": gen.temperature, "seed": seed, "n": 1,
                "stop_token_ids": sorted(self.eos_ids), "return_token_ids": True}
        if gen.do_sample:
            body["top_p"] = gen.top_p
        with self.lock:  # the least busy endpoint (first on a tie)
            i = min(range(len(self.endpoints)), key=lambda e: self.in_flight[e])
        answer = self._request(i, "POST", "/completions", body, "a completion")
        choice = checked_choice(answer, len(self.tokenizer), self.endpoints[i])
        return self._to_reply(choice, answer.get("usage"))

    def _to_reply(self, choice: dict, usage) -> Reply:
        """One completion choice (checked_choice's) -> Reply: the server's token ids (or the
        text re-tokenized and checked), the end-of-turn token kept as the local backends keep
        it. A finish reason, stop reason or usage of the wrong type counts as absent."""
        reason = choice.get("finish_reason")
        reason = reason if isinstance(reason, str) else None
        usage = usage if isinstance(usage, dict) else {}
        ids = choice.get("token_ids")
        with self.lock:
            self.stats.replies += 1
            self.stats.with_token_ids += ids is not None
            self.stats.no_finish_reason += reason is None
        if ids is None:
            text = choice.get("text") or ""
            ids = encode(self.tokenizer, text)
            counted = usage.get("completion_tokens")
            if not isinstance(counted, int) or isinstance(counted, bool):
                counted = None
            stop = reason == "stop" and not (ids and ids[-1] in self.eos_ids)
            mismatch = (self.tokenizer.decode(ids, skip_special_tokens=False) != text
                        or counted is not None and counted != len(ids) + stop)
            with self.lock:
                self.stats.retokenized_mismatches += mismatch
        ids = [int(t) for t in ids]
        finished = reason == "stop"
        if finished and (not ids or ids[-1] not in self.eos_ids):  # kept as the local backends
            stop_reason = choice.get("stop_reason")  # vLLM: the stop token's id
            known = isinstance(stop_reason, int) and stop_reason in self.eos_ids
            ids.append(stop_reason if known else min(self.eos_ids))
        return Reply(ids, finished, reason or "none")

    def _request(self, i: int, method: str, path: str, body: dict | None, what: str,
                 rotate: bool = True) -> dict:
        """One request with retries (on the next endpoint after a failure, when rotate)."""
        import httpx

        last = ""
        for attempt in range(self.gen.openai_max_retries + 1):
            url = self.endpoints[i] + path
            wait = min(60.0, 2.0 ** attempt) * (0.5 + random.random() / 2)
            with self.slots[i]:
                with self.lock:
                    self.in_flight[i] += 1
                try:
                    named = {**body, "model": self.served_names[i]} if body else None
                    response = self.client.request(method, url, json=named)
                except httpx.HTTPError as e:  # refused, dropped, timed out
                    response, last = None, f"{type(e).__name__}: {e}"
                finally:
                    with self.lock:
                        self.in_flight[i] -= 1
            if response is not None:
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError:
                        last = f"200 with a body that is not JSON: {response.text[:200]!r}"
                elif response.status_code in RETRIED:
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                    after = response.headers.get("Retry-After", "")
                    if after.replace(".", "", 1).isdigit():  # the server's wait, bounded
                        wait = min(float(after), MAX_RETRY_AFTER_S)
                else:
                    raise EndpointError(
                        f"{url} answered {what} with HTTP {response.status_code}: "
                        f"{response.text[:400]}. This is not a retryable error: check the "
                        "server and generation.openai_* (model name, API key in "
                        f"${self.gen.openai_api_key_env}). Every whole batch written is kept.")
            if attempt == self.gen.openai_max_retries:
                break
            with self.lock:
                self.stats.retries += 1
            time.sleep(wait)
            i = (i + 1) % len(self.endpoints) if rotate else i
        raise EndpointError(
            f"{what} failed {self.gen.openai_max_retries + 1} times (last at {url}: {last}). "
            "Check that the servers are up (curl <endpoint>/models) and reachable from here, "
            "then run stage 1 again: every whole batch written is kept and the rest resumes.")

    def check_retokenized(self) -> None:
        """Stop when too many text-only replies did not re-tokenize to what the server wrote."""
        s = self.stats
        text_only = s.replies - s.with_token_ids
        limit = self.gen.openai_max_retokenized * text_only
        if text_only >= 20 and s.retokenized_mismatches > limit:
            raise EndpointError(
                f"{s.retokenized_mismatches} of {text_only} replies returned as text only did "
                "not re-tokenize to the tokens the server counted (or did not decode back to "
                f"its text), above generation.openai_max_retokenized="
                f"{self.gen.openai_max_retokenized}: the data would not be the target's tokens. "
                "Serve the target with vLLM or serving.server (they return token ids), or raise "
                "the limit knowingly. Every whole batch written is kept.")

    def after_batch(self) -> None:
        self.check_retokenized()

    def report(self) -> str | None:
        return f"servers: {self.stats}"

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
