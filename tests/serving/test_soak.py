"""serving.server in its own process (a tiny random target) under benchmarks.soak_server's two
phases, scaled down: requests generated from the server's /openapi.json
and a concurrent soak with more clients than the queue holds, clients that leave, give up or
read slowly. No 5xx, no hang, every request counted once, nothing left admitted, the server
alive, its memory and threads bounded. The 10,000-request run is the benchmark's."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.soak_server import THREAD_SLACK, failures, fuzz, phase, soak
from eval.bench_server import server
from tests.helpers import recipe_path


@pytest.mark.slow
def test_the_server_survives_generated_requests_and_a_soak_losing_none(tiny_target, tmp_path):
    overrides = [f"model.target={tiny_target}", "model.dtype=float32",
                 f"run.output_dir={tmp_path / 'served'}"]
    with server(recipe_path("smollm2-135m-independent"), overrides, [], 4, 4, 6,
                process=True) as (url, model, process):
        name = model["id"]
        fuzz(url, {}, name, 50, 6, 60)  # warm: first requests allocate the caches
        results = [
            phase("fuzz", lambda: fuzz(url, {}, name, 400, 6, 60), url, {}, process.pid),
            phase("soak", lambda: soak(url, {}, name, 8, 60, 6, 60), url, {}, process.pid)]
        assert process.poll() is None and httpx.get(url + "/health", timeout=10).is_success
    for r in results:
        assert failures(r) == [], r
        assert r["after"]["rss_mib"] - r["before"]["rss_mib"] < 64, r
        assert r["after"]["threads"] <= r["before"]["threads"] + THREAD_SLACK, r
    fuzzed, soaked = results[0]["statuses"], results[1]["outcomes"]
    assert fuzzed.get(200, 0) > 20 and fuzzed.get(400, 0) > 100, fuzzed  # both paths reached
    assert soaked.get("refused 429", 0) > 0 and soaked.get("left", 0) > 0, soaked
