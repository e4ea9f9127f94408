"""Stage 1 through a real server in its own process: serving.server killed mid-run and restarted
loses nothing and writes nothing twice. Stage 1 through vLLM's OpenAI server (the target with
an exported draft speculating) writing the rows of vLLM's offline engine is
tests/serving/test_validate_vllm.py's (one vLLM server start for both checks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from runfolder import read_manifest
from tests.helpers import (
    ROOT,
    chat_records,
    free_port,
    kill_process_tree,
    recipe_path,
    stage1_rows,
    write_jsonl,
)


def _wait_until_up(url: str, process, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before answering")
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {seconds} s")


def _overrides(tiny_target, prompts, out, *extra):
    return [f"model.target={tiny_target}", f"data.sources=[{prompts}]", f"run.output_dir={out}",
            "data.max_prompts=null", "data.held_out_fraction=0.25", "data.max_prompt_tokens=null",
            "model.dtype=float32", "train.draft=layer-truncated:1", *extra]


def _distill(overrides, **kw):
    return subprocess.Popen([sys.executable, str(ROOT / "distill.py"), "--config",
                             recipe_path("smollm2-135m-independent"), "--stage", "distill",
                             *overrides], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
def test_our_server_killed_mid_run_and_restarted_loses_nothing(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(24))
    common = ["generation.max_new_tokens=16", "generation.batch_size=2", "data.shard_size=2"]
    local = _distill(_overrides(tiny_target, prompts, tmp_path / "hf", "generation.backend=hf",
                                *common))
    assert local.wait(timeout=600) == 0, local.stdout.read()[-3000:]
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"

    def start_server():
        return subprocess.Popen([sys.executable, "-m", "serving.server", "--config",
                                 recipe_path("smollm2-135m-independent"), "--port", str(port),
                                 f"model.target={tiny_target}", "model.dtype=float32",
                                 f"run.output_dir={tmp_path / 'served'}"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    server = start_server()
    _wait_until_up(url, server)
    out = tmp_path / "remote"
    remote = _distill(_overrides(tiny_target, prompts, out, "generation.backend=openai",
                                 *common, f"generation.openai_endpoints=[{url}]",
                                 "generation.openai_concurrency=2"))
    try:
        deadline = time.time() + 300
        while not list((out / "data").glob("*.parquet")) and time.time() < deadline:
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL)  # mid-run: some batches written, more to come
        server.wait()
        written = len(list((out / "data").glob("*.parquet")))
        time.sleep(3)
        server = start_server()
        log = remote.communicate(timeout=600)[0]
    finally:
        kill_process_tree(server.pid)
        kill_process_tree(remote.pid)
    assert remote.returncode == 0, log[-3000:]
    assert 0 < written, "the server was killed before any batch was written"
    stats = next(ln for ln in log.splitlines() if "[distill] servers:" in ln)
    assert "retries=0" not in stats, stats  # the kill was met, and retried through
    manifest = read_manifest(out)
    assert manifest["status"] == "complete" and manifest["generated_by"] == {"openai": 24}
    assert stage1_rows(out) == stage1_rows(tmp_path / "hf")  # nothing lost, nothing written twice
