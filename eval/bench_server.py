"""Benchmark: serving.server under load, on 127.0.0.1 only, with and without speculation.

    .venv/bin/python -m eval.bench_server --config configs/smollm2-135m-independent.yaml \\
        [--clients 4] [--requests 16] [--max-tokens 64] [--draft NAME=SPEC] [--kill-every 4]

The server runs in this process (a uvicorn thread, the recipe's target and dtype); --clients
threads of the official openai client stream greedy chat completions of MT-bench first turns,
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from assets.prompts import load_mtbench
from recipe import load_config
from serving.server import Background, Limits, Served, create_app, parse_drafts


def _quantile(values: list[float], q: float) -> float:
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
    cfg = load_config(args.config, overrides)
    torch.manual_seed(cfg.run.seed)
    served = Served(cfg, parse_drafts(args.draft), torch.device("cpu"))
    conversations, _ = load_mtbench()
    prompts = [c.first_turn() for c in conversations[: args.prompts]]
    drafts = list(served.drafts)
    print(f"[bench] {served.model_id} ({cfg.model.dtype}), drafts {drafts}, {args.clients} "
          f"clients, {args.requests} requests per phase, {args.max_tokens} new tokens, greedy, "
          f"k={args.k}, max batch {args.max_batch}, torch threads {torch.get_num_threads()}",
          flush=True)
    limits = Limits(max_queue=max(64, args.clients), max_batch=args.max_batch,
                    max_tokens=args.max_tokens)
    results = {}
    with Background(create_app(served, limits)) as url:
        alone = run_phase(url, served.model_id, prompts, 1, len(prompts), args.max_tokens,
                          {"speculative_decoding": False}, None, 0)
        reference = alone["texts"]
        phases = [("off", {"speculative_decoding": False})] + [
            (name, {"draft_model": name, "max_speculative_tokens": args.k}) for name in drafts]
        for name, extra in phases:
            results[name] = run_phase(url, served.model_id, prompts, args.clients,
                                      args.requests, args.max_tokens, extra, reference,
                                      args.kill_every)
            print(f"[bench] {name}: {results[name]['tokens_per_s']:.1f} tokens/s", flush=True)
    busy = Limits(max_queue=args.clients, max_batch=args.max_batch, max_tokens=args.max_tokens)
    with Background(create_app(served, busy)) as url:
        best = max(drafts, key=lambda n: results[n]["tokens_per_s"])
        results[f"{best}, overloaded"] = run_phase(
            url, served.model_id, prompts, args.clients * args.overload, args.requests,
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
