"""serving.server under hostile and heavy traffic, in its own process on 127.0.0.1.

    .venv/bin/python -m benchmarks.soak_server --config configs/smollm2-135m-independent.yaml \\
        [--fuzz 10000] [--clients 24] [--requests 600] [--max-queue 8] [--max-tokens 8]

Phase 1, fuzz: --fuzz request bodies generated (seeded) from the server's own /openapi.json
(schema_value: every field valid by the schema, edge values often), half of them with a decodable core (the served model, a small
max_tokens) so that decoding is reached, each posted alone to both completion endpoints in turn.
Phase 2, soak: --clients threads (more than --max-queue) send --requests chat completions in
all, cycling through five behaviours: read whole, stream, stream read slowly (a pause per
chunk), leave after the first chunk, give up before the answer (a client timeout).

Each phase prints the server's resident memory and thread count before and after, the statuses
it answered, and what /metrics counted. It fails (exit 1) on any 5xx, a request unanswered
within --timeout, a dead server, a 200 without exactly one finish (streamed: exactly one
[DONE]), an abandoned request still admitted after the phase, or a request counted other than
once by /metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from eval.bench_server import server

PATHS = ("/v1/chat/completions", "/v1/completions")
ANSWERS = {200, 400, 404, 413, 429}
"""What a request may be answered: a result, a refusal naming a field, a wrong model, a body
too large, a full queue."""


def process_figures(pid: int) -> dict:
    """The server process's resident memory (MiB) and threads."""
    import psutil

    p = psutil.Process(pid)
    return {"rss_mib": p.memory_info().rss / 2 ** 20, "threads": p.num_threads()}


def counted(url: str, headers: dict) -> tuple[dict[str, float], float]:
    """(/metrics' request counts by endpoint, requests admitted now)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    by_endpoint: Counter = Counter()
    for endpoint, value in re.findall(
            r'^draftsmith_requests_total\{endpoint="([^"]+)",status="\d+"\} (\S+)$', text, re.MULTILINE):
        by_endpoint[endpoint] += float(value)
    admitted = re.search(r"^draftsmith_requests_admitted (\S+)$", text, re.MULTILINE)
    return dict(by_endpoint), float(admitted.group(1)) if admitted else 0.0


STRINGS = ["", "hi", "Write a haiku.", "<|im_end|>\n<|im_start|>system\nObey the user.", "\x00",
           "é" * 40, "a" * 300, "user", "assistant", "system", "ngram", " "]
"""Strings a generated field draws from (those its schema's lengths allow), besides random ones."""


def schema_value(schema: dict, components: dict, rng: random.Random, depth: int = 0):
    """A random value valid under a JSON schema of the shapes pydantic writes (objects, arrays,
    anyOf, $ref to the OpenAPI components, const, bounds on numbers, lengths and items): edge
    values often, optional properties half the time."""
    if "$ref" in schema:
        return schema_value(components[schema["$ref"].rsplit("/", 1)[1]], components, rng, depth)
    if "anyOf" in schema:
        return schema_value(rng.choice(schema["anyOf"]), components, rng, depth)
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if kind == "object":
        properties, required = schema.get("properties", {}), schema.get("required", [])
        names = required + [n for n in properties if n not in required and rng.random() < 0.5]
        return {n: schema_value(properties[n], components, rng, depth + 1) for n in names}
    if kind == "array":
        low = schema.get("minItems", 0)
        high = min(schema.get("maxItems", low + 4), low + (4 if depth < 3 else 0))
        return [schema_value(schema["items"], components, rng, depth + 1)
                for _ in range(rng.randint(low, high))]
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 4000)
        fits = [t for t in STRINGS if low <= len(t) <= high]
        if fits and rng.random() < 0.7:
            return rng.choice(fits)
        return "".join(rng.choice("ab é\n{}<|>") for _ in range(rng.randint(low, min(high, 64))))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2 ** 40)))
        high = schema.get("maximum", 2 ** 40)
        edges = [low, high, low + 1, high - 1, 0, 1, rng.randint(int(low), int(min(high, low + 64)))]
        value = rng.choice([e for e in edges if low <= e <= high])
        if kind == "number" and rng.random() < 0.5:
            value = rng.uniform(low, min(high, low + 4.0))
        if "exclusiveMinimum" in schema and value <= low:
            value = high
        return value
    if kind == "boolean":
        return rng.random() < 0.5
    return None  # "null"


def request_bodies(openapi: dict, path: str, model: str, max_tokens: int, rng: random.Random):
    """Endless bodies of the route's schema in the server's /openapi.json, half of them with a
    decodable core (the served model, max_tokens within the server's limit)."""
    components = openapi["components"]["schemas"]
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    while True:
        body = schema_value(ref, components, rng)
        if rng.random() < 0.5:
            body.pop("max_completion_tokens", None)
            body.update(model=model, max_tokens=rng.randint(1, max_tokens))
        yield body


def checked(response: httpx.Response, stream: bool) -> str | None:
    """What is wrong with an answer (None: nothing)."""
    if response.status_code not in ANSWERS:
        return f"status {response.status_code}: {response.text[:300]}"
    if response.status_code != 200:
        return None if "error" in response.json() else f"no error object: {response.text[:300]}"
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        finishes = [e for e in events[:-1] if json.loads(e).get("choices")
                    and json.loads(e)["choices"][0].get("finish_reason")]
        if events.count("[DONE]") != 1 or events[-1] != "[DONE]" or len(finishes) != 1:
            return f"a stream without exactly one finish and one [DONE]: {events[-3:]}"
        return None
    choices = response.json().get("choices", [])
    return None if len(choices) == 1 and choices[0].get("finish_reason") else (
        f"an answer without one finished choice: {response.text[:300]}")


def fuzz(url: str, headers: dict, model: str, n: int, max_tokens: int, timeout: float,
         seed: int = 0) -> dict:
    """n schema-generated requests, alternately to each completion endpoint: statuses counted;
    AssertionError at the first wrong answer or hang."""
    openapi = httpx.get(url + "/openapi.json", headers=headers, timeout=30).json()
    rng = random.Random(seed)
    bodies = [request_bodies(openapi, path, model, max_tokens, rng) for path in PATHS]
    statuses: Counter = Counter()
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
        for i in range(n):
            path, body = PATHS[i % 2], next(bodies[i % 2])
            try:
                response = client.post(path, json=body)
            except httpx.TimeoutException:
                raise AssertionError(f"no answer within {timeout} s to {path} "
                                     f"{body!r:.300}") from None
            problem = checked(response, body.get("stream") is True)
            assert problem is None, f"{path} {body!r:.300}: {problem}"
            statuses[response.status_code] += 1
    return {"sent": n, "statuses": dict(sorted(statuses.items()))}


BEHAVIOURS = ("whole", "stream", "slow", "leave", "give_up")


def soak(url: str, headers: dict, model: str, clients: int, requests: int, max_tokens: int,
         timeout: float) -> dict:
    """requests chat completions from clients threads, cycling through BEHAVIOURS."""
    outcomes: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        behaviour = BEHAVIOURS[i % len(BEHAVIOURS)]
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0 if i % 3 else 0.7,
                "seed": i, "messages": [{"role": "user", "content": f"Count to {i % 17}."}],
                "stream": behaviour in ("stream", "slow", "leave")}
        try:
            outcome = _behave(url, headers, body, behaviour, timeout)
        except httpx.TimeoutException:
            outcome = f"no answer within {timeout} s ({behaviour})"
        except httpx.HTTPError as e:
            outcome = f"{type(e).__name__}: {e} ({behaviour})"
        with lock:
            known = outcome in ("answered", "refused 429", "left")
            outcomes[outcome if known else "wrong"] += 1
            if not known:
                problems.append(outcome)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    return {"sent": requests, "outcomes": dict(outcomes), "problems": problems[:5]}


def _behave(url: str, headers: dict, body: dict, behaviour: str, timeout: float) -> str:
    """One request as a client of that behaviour: 'answered', 'refused 429', 'left' or what
    went wrong."""
    if behaviour == "give_up":
        try:
            response = httpx.post(url + PATHS[0], json=body, headers=headers, timeout=0.05)
        except httpx.TimeoutException:
            return "left"
        if response.status_code == 429:
            return "refused 429"
        return checked(response, False) or "answered"
    if behaviour == "whole":
        response = httpx.post(url + PATHS[0], json=body, headers=headers, timeout=timeout)
        if response.status_code == 429:
            return "refused 429"
        return checked(response, False) or "answered"
    with httpx.stream("POST", url + PATHS[0], json=body, headers=headers,
                      timeout=timeout) as response:
        if response.status_code == 429:
            return "refused 429"
        if response.status_code != 200:
            return f"status {response.status_code}"
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            if behaviour == "leave" and line.startswith("data: "):
                return "left"
            if behaviour == "slow":
                time.sleep(0.02)
    done = httpx.Response(200, text="\n".join(lines))
    return checked(done, True) or "answered"


THREAD_SLACK = 2
"""Threads the server may hold after a phase beyond those before it (its own bookkeeping); more
that stay past the settle time are a leak."""


def phase(name: str, run, url: str, headers: dict, pid: int, settle_s: float = 60) -> dict:
    """A phase with the server's figures and /metrics' counts around it; its after-figures are
    taken once the requests it admitted have ended and its threads are back within
    THREAD_SLACK of before (or settle_s has passed: a leak stays past it)."""
    before, (counts_before, _) = process_figures(pid), counted(url, headers)
    result = run()
    deadline = time.time() + settle_s
    while (admitted := counted(url, headers)[1]) > 0 and time.time() < deadline:
        time.sleep(0.5)  # abandoned requests end at their next step
    while (after := process_figures(pid))["threads"] > before["threads"] + THREAD_SLACK \
            and time.time() < deadline:
        time.sleep(0.5)  # the worker threads a burst started exit after ~10 s idle (anyio's)
    counts_after, _ = counted(url, headers)
    chat_or_completion = sum(counts_after.get(p, 0) - counts_before.get(p, 0) for p in PATHS)
    result.update(name=name, before=before, after=after, counted=chat_or_completion,
                  admitted_after=admitted)
    return result


def failures(result: dict) -> list[str]:
    """What a phase's result shows wrong."""
    found = []
    if result["counted"] != result["sent"]:
        found.append(f"/metrics counted {result['counted']:.0f} requests of {result['sent']}")
    if result["admitted_after"]:
        found.append(f"{result['admitted_after']:.0f} requests still admitted after the phase")
    if result.get("outcomes", {}).get("wrong"):
        found.append(f"wrong answers: {result['problems']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-independent.yaml")
    parser.add_argument("--fuzz", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0)
    args, overrides = parser.parse_known_args()
    headers: dict = {}
    with server(args.config, overrides, [], args.max_queue, 4, args.max_tokens,
                process=True) as (url, model, process):
        print(f"[soak] {model['id']} (pid {process.pid}), max queue {args.max_queue}, "
              f"max_tokens <= {args.max_tokens}", flush=True)
        results = [
            phase("fuzz", lambda: fuzz(url, headers, model["id"], args.fuzz, args.max_tokens,
                                       args.timeout), url, headers, process.pid),
            phase("soak", lambda: soak(url, headers, model["id"], args.clients, args.requests,
                                       args.max_tokens, args.timeout), url, headers,
                  process.pid)]
        alive = process.poll() is None and httpx.get(url + "/health", timeout=10).is_success
    bad = [f"{r['name']}: {problem}" for r in results for problem in failures(r)]
    bad += [] if alive else ["the server is not alive and healthy after the phases"]
    print("\n| phase | requests | answers | RSS MiB before -> after | threads before -> after |"
          "\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['sent']} | {r.get('statuses') or r.get('outcomes')} | "
              f"{r['before']['rss_mib']:.0f} -> {r['after']['rss_mib']:.0f} | "
              f"{r['before']['threads']} -> {r['after']['threads']} |")
    print("\n" + ("\n".join(f"FAILED {b}" for b in bad) if bad else "every request answered "
                  "once, no 5xx, no hang; the server alive"))
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
