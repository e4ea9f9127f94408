"""Stage 1 end to end on a tiny random target: output, resume after a real kill, refusals."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from distill import load_distilled
from runfolder.shards import read_columns, shard_files
from tests.helpers import (
    ROOT,
    accelerate_launch,
    chat_records,
    kill_process_tree,
    recipe_path,
    run_recipe,
    write_jsonl,
)


def _args(tiny_target, prompts, out, *extra):
    return ["--config", recipe_path("smollm2-135m-independent"),
            "--stage", "distill", f"model.target={tiny_target}", f"data.sources=[{prompts}]",
            f"run.output_dir={out}", "data.max_prompts=null", "data.held_out_fraction=0.25",
            "data.max_prompt_tokens=null", "generation.max_new_tokens=6", "generation.backend=hf",
            "train.draft=layer-truncated:1",
            *extra]


def _run(args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "distill.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


def test_distill_writes_masked_sharded_data_with_manifest(tiny_target, tmp_path,
                                                         smollm2_tokenizer):
    from accelerate import Accelerator

    from distill import run_distill
    from recipe import load_config

    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(10))
    out = tmp_path / "out"
    args = _args(tiny_target, prompts, out, "generation.top_k_logprobs=3", "data.shard_size=4",
                 "generation.batch_size=3")
    cfg = load_config(args[1], args[4:])
    summary = run_distill(cfg, Accelerator(cpu=True))
    tok = smollm2_tokenizer
    manifest = summary.manifest
    assert manifest["status"] == "complete" and summary.generated_now == 10
    assert manifest["generated_by"] == {"hf": 10}
    assert (out / "config.yaml").is_file() and load_config(out / "config.yaml") == cfg
    ds = load_distilled(out)
    assert len(ds["train"]) + len(ds["held_out"]) == 10
    assert sorted(manifest["split"]["held_out_ids"]) == sorted(ds["held_out"]["id"])
    for row in ds["train"]:
        n_masked = sum(row["loss_mask"])
        assert len(row["input_ids"]) == len(row["loss_mask"])
        messages = json.loads(row["messages"])
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # no reply of a random target stops early, so no end-of-turn token is masked
        assert tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]) == \
            "".join(replies)
        assert len(row["topk_ids"]) == n_masked and len(row["topk_ids"][0]) == 3
        assert row["topk_logprobs"][0] == sorted(row["topk_logprobs"][0], reverse=True)
        assert row["num_turns"] == (2 if int(row["id"].split(":c")[1]) % 2 else 1)
        assert row["finish_reasons"] == ["length"] * row["num_turns"]
        assert [m["role"] for m in messages][-1] == "assistant"
    counts = manifest["counts"]
    assert counts["train"]["conversations"] == len(ds["train"])
    assert counts["train"]["assistant_tokens"] == sum(sum(r) for r in ds["train"]["loss_mask"])


def test_output_from_other_settings_is_refused_and_left_intact(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(3))
    out = tmp_path / "out"
    assert run_recipe(_args(tiny_target, prompts, out))[0] == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    code, _, err = run_recipe(_args(tiny_target, prompts, out, "generation.max_new_tokens=7"))
    assert code == 2
    assert "refusing to mix" in err and "generation.max_new_tokens: 6" in err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_a_run_that_would_not_fit_on_the_disk_is_refused_before_writing(tiny_target, tmp_path,
                                                                        monkeypatch):
    import shutil

    from accelerate import Accelerator

    from distill import run_distill
    from recipe import ConfigError, load_config

    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(3))
    args = _args(tiny_target, prompts, tmp_path / "out")
    cfg = load_config(args[1], [a for a in args[4:]])
    usage = shutil.disk_usage("/")
    monkeypatch.setattr("recipe.disk.shutil.disk_usage", lambda path: usage._replace(free=100))
    with pytest.raises(ConfigError, match=r"stage 1 \(3 conversations to generate\) needs about "
                                          r".* GiB .* Nothing was written"):
        run_distill(cfg, Accelerator(cpu=True))
    assert not (tmp_path / "out").exists()


def test_shards_without_a_manifest_are_refused(tiny_target, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(3))
    (tmp_path / "out" / "data").mkdir(parents=True)
    (tmp_path / "out" / "data" / "train-r0-00000.parquet").write_bytes(b"foreign")
    code, _, err = run_recipe(_args(tiny_target, prompts, tmp_path / "out"))
    assert code == 2 and "no manifest.json" in err


@pytest.mark.parametrize("overlong, kept", [("skip", 2), ("truncate", 3)])
def test_overlong_first_prompts_are_skipped_or_truncated(tiny_target, tmp_path, overlong, kept):
    records = chat_records(2) + [{"id": "long", "prompt": "word " * 400}]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    out = tmp_path / overlong
    code, _, err = run_recipe(_args(tiny_target, prompts, out, "data.max_prompt_tokens=120",
                                    f"data.overlong={overlong}"))
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    written = read_columns(out / "data", ["id", "input_ids", "loss_mask"])
    assert len(written) == kept
    assert manifest["skipped"] == ({"prompt over max_prompt_tokens": 1} if kept == 2 else {})
    for row in written:  # the prompt part (before the first reply) fits the limit
        assert row["loss_mask"].index(1) <= 120


def test_bad_config_exits_2_with_the_message(tmp_path):
    code, _, err = run_recipe(["--config", recipe_path("smollm2-135m-independent"),
                               "data.max_promts=3"])
    assert code == 2 and "valid keys of 'data'" in err


def _rows(out: Path) -> list[dict]:
    columns = ["id", "split", "messages", "input_ids", "loss_mask", "num_turns",
               "generated_tokens", "finish_reasons"]
    return sorted(read_columns(out / "data", columns), key=lambda r: r["id"])


@pytest.mark.slow
def test_killed_twice_then_resumed_writes_what_an_uninterrupted_run_writes(tiny_target,
                                                                           tmp_path):
    """Every reply is a function of its conversation alone (its own seed, its batch as in an
    uninterrupted run), so SIGKILL at two seeded random points changes nothing written: every
    prompt once, each row as the uninterrupted run wrote it. Sampled over two processes (each
    row's own seed, each process's share of the shards). The resumed run says what it keeps,
    and a run of the complete folder rewrites nothing."""
    n = 36
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(n))
    extra = ["data.shard_size=2", "generation.batch_size=3", "generation.max_new_tokens=24",
             "generation.temperature=0.9", "generation.top_p=0.95"]
    launcher = accelerate_launch("ddp-cpu.yaml")

    def command(out):
        return [*launcher, str(ROOT / "distill.py"), *_args(tiny_target, prompts, out, *extra)]

    reference = tmp_path / "reference"
    done = subprocess.run(command(reference), cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]

    out, rng, kills = tmp_path / "killed", random.Random("sampled-2"), 0
    for _ in range(2):
        proc = subprocess.Popen(command(out), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        wanted = len(shard_files(out / "data")) + rng.randint(1, 3)
        deadline = time.time() + 300
        while len(shard_files(out / "data")) < wanted and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside a later batch or shard write
        if proc.poll() is None:
            kill_process_tree(proc.pid)
            kills += 1
        proc.wait()
    if kills != 2:
        pytest.fail(f"{2 - kills} of the 2 runs finished before they could be killed: raise n "
                    f"above {n} so every kill lands inside a run")
    written_before = len(read_columns(out / "data", ["id"]))
    assert 0 < written_before < n
    assert json.loads((out / "manifest.json").read_text())["status"] == "in_progress"
    resumed = subprocess.run(command(out), cwd=ROOT, capture_output=True, text=True,
                             timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"({written_before} already written, {n - written_before} to generate)" in \
        resumed.stdout + resumed.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    ids = Counter(r["id"] for r in read_columns(out / "data", ["id"]))
    assert set(ids) == {f"p.jsonl:c{i}" for i in range(n)} and set(ids.values()) == {1}
    assert _rows(out) == _rows(reference)

    files = {p: p.stat().st_mtime_ns for p in shard_files(out / "data")}
    again = _run(_args(tiny_target, prompts, out, *extra))
    assert again.returncode == 0 and "already complete" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in shard_files(out / "data")} == files
