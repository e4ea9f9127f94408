"""Benchmark: serving.server under load, on 127.0.0.1 only, with and without speculation.

    .venv/bin/python -m eval.bench_server --config configs/smollm2-135m-independent.yaml \\
        [--clients 4] [--requests 16] [--max-tokens 64] [--draft NAME=SPEC] [--kill-every 4]

The server runs as its own process (`python -m serving.server`, the recipe's target and dtype,
started and stopped here, as a user would run it); --clients threads of the official openai client stream greedy chat completions of MT-bench first turns,
--requests in all per phase. Phases: speculation off; on with each draft given (the run's
trained draft by default, and 'ngram'); then the same with --overload x more clients than the
queue holds. Every response is compared with the text the server gives the same prompt alone
and without speculation: 'lost' counts requests without a complete answer (that were not
answered 429), 'differs' answers whose text is not that reference (greedy: speculation must not
change it; batching may only at a numerical tie). Every --kill-every-th request is abandoned
by its client after the first chunk (its slot must be freed; it is not counted as lost).
Prints p50/p99 latency and time to first token, aggregate tokens/s, 429s.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from assets.prompts import load_mtbench


def _quantile(values: list[float], q: float) -> float:
    """Nearest rank (the figures in docs/serving.md); nan for no value."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_phase(url: str, model: str, prompts: list[list[dict]], clients: int, requests: int,
              max_tokens: int, extra: dict, reference: dict[int, str] | None,
              kill_every: int) -> dict:
    from openai import OpenAI, RateLimitError

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    lock = threading.Lock()
    rows: list[dict] = []

    def one(i: int) -> None:
        p = i % len(prompts)
        start = time.perf_counter()
        row = {"prompt": p, "status": "ok", "ttft": None, "tokens": 0, "text": ""}
        try:
            stream = client.chat.completions.create(
                model=model, messages=prompts[p], max_tokens=max_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body=extra)
            parts, finish = [], None
            for chunk in stream:
                if chunk.choices:
                    if row["ttft"] is None:
                        row["ttft"] = time.perf_counter() - start
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                    if kill_every and i % kill_every == kill_every - 1:
                        stream.close()
                        row["status"] = "killed"
                        break
                if chunk.usage is not None:
                    row["tokens"] = chunk.usage.completion_tokens
                    row["usage"] = chunk.usage.model_extra
            row["text"] = "".join(parts)
            if row["status"] == "ok" and finish is None:
                row["status"] = "lost"
        except RateLimitError:
            row["status"] = "429"
        except Exception as e:  # noqa: BLE001 - a benchmark counts failures, it does not stop
            row["status"], row["error"] = "lost", f"{type(e).__name__}: {e}"
        row["latency"] = time.perf_counter() - start
        with lock:
            rows.append(row)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    ok = [r for r in rows if r["status"] == "ok"]
    drafted = sum(r.get("usage", {}).get("drafted_tokens", 0) for r in ok)
    accepted = sum(r.get("usage", {}).get("accepted_tokens", 0) for r in ok)
    steps = sum(r.get("usage", {}).get("verify_steps", 0) for r in ok)
    return {
        "requests": requests, "ok": len(ok), "429": sum(r["status"] == "429" for r in rows),
        "killed": sum(r["status"] == "killed" for r in rows),
        "lost": sum(r["status"] == "lost" for r in rows),
        "differs": (sum(r["text"] != reference[r["prompt"]] for r in ok)
                    if reference is not None else 0),
        "p50_s": _quantile([r["latency"] for r in ok], 0.5),
        "p99_s": _quantile([r["latency"] for r in ok], 0.99),
        "ttft_p50_s": _quantile([r["ttft"] for r in ok if r["ttft"] is not None], 0.5),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall, "wall_s": wall,
        "tau": 1 + accepted / steps if steps and drafted else None, "drafted": drafted,
        "errors": [r["error"] for r in rows if "error" in r][:3],
        "texts": {r["prompt"]: r["text"] for r in ok}}


@contextlib.contextmanager
def server(config: str, overrides: list[str], drafts: list[str], max_queue: int,
           max_batch: int, max_tokens: int, process: bool = False):
    """`python -m serving.server` on a free port of 127.0.0.1 -> (its url, /v1/models' entry),
    and its process too when asked."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "serving.server", "--config", config, "--port", str(port),
               "--max-queue", str(max_queue), "--max-batch", str(max_batch), "--max-tokens",
               str(max_tokens), *[f"--draft={d}" for d in drafts], *overrides]
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(command)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise SystemExit("the server did not answer /health within 600 s")
            time.sleep(1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        yield (url, model, proc) if process else (url, model)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-independent.yaml")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=SPEC")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--kill-every", type=int, default=4)
    parser.add_argument("--overload", type=int, default=3,
                        help="the overload phase: this many times --clients, queue of --clients")
    args, overrides = parser.parse_known_args()
    conversations, _ = load_mtbench()
    prompts = [c.first_turn() for c in conversations[: args.prompts]]
    results = {}
    start = (args.config, overrides, args.draft)
    with server(*start, max(64, args.clients), args.max_batch, args.max_tokens) as (url, model):
        drafts = model["drafts"]
        print(f"[bench] {model['id']}, drafts {drafts}, {args.clients} clients, {args.requests} "
              f"requests per phase, {args.max_tokens} new tokens, greedy, k={args.k}, max batch "
              f"{args.max_batch}", flush=True)
        alone = run_phase(url, model["id"], prompts, 1, len(prompts), args.max_tokens,
                          {"speculative_decoding": False}, None, 0)
        reference = alone["texts"]
        phases = [("off", {"speculative_decoding": False})] + [
            (name, {"draft_model": name, "max_speculative_tokens": args.k}) for name in drafts]
        for name, extra in phases:
            results[name] = run_phase(url, model["id"], prompts, args.clients, args.requests,
                                      args.max_tokens, extra, reference, args.kill_every)
            print(f"[bench] {name}: {results[name]['tokens_per_s']:.1f} tokens/s", flush=True)
    best = max(drafts, key=lambda n: results[n]["tokens_per_s"])
    with server(*start, args.clients, args.max_batch, args.max_tokens) as (url, model):
        results[f"{best}, overloaded"] = run_phase(
            url, model["id"], prompts, args.clients * args.overload, args.requests,
            args.max_tokens, {"draft_model": best, "max_speculative_tokens": args.k},
            reference, args.kill_every)
    print("\n| speculation | requests | ok | 429 | abandoned | lost | differs | p50 s | p99 s | "
          "TTFT p50 s | tokens/s | tau |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        tau = f"{r['tau']:.3f}" if r["tau"] else "-"
        print(f"| {name} | {r['requests']} | {r['ok']} | {r['429']} | {r['killed']} | "
              f"{r['lost']} | {r['differs']} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | "
              f"{r['ttft_p50_s']:.2f} | {r['tokens_per_s']:.1f} | {tau} |")
        if r["errors"]:
            print(f"  errors: {r['errors']}")


if __name__ == "__main__":
    main()
