"""Shared fixtures: the embedded target's tokenizer and a tiny random 2-layer target using it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def temporary_cache(tmp_path_factory) -> Path:
    """Every test (and every process a test starts) writes under a temporary cache, never the
    user's ~/.cache/draftsmith: the converted target, runs, vLLM's compile cache."""
    cache = tmp_path_factory.mktemp("draftsmith-cache")
    before = os.environ.get("DRAFTSMITH_CACHE")
    os.environ["DRAFTSMITH_CACHE"] = str(cache)
    # llama.cpp's build (~4 min on 2 cores) is a tool, not user data: built once per machine
    # for the tests, in a folder of their own (serving/llamacpp.py; $DRAFTSMITH_LLAMACPP wins)
    if "DRAFTSMITH_LLAMACPP" not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        os.environ["DRAFTSMITH_LLAMACPP"] = str(Path(base) / "draftsmith-tests" / "llamacpp")
    yield cache
    if before is None:
        os.environ.pop("DRAFTSMITH_CACHE", None)
    else:
        os.environ["DRAFTSMITH_CACHE"] = before


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder (converted once into the cache)."""
    from assets.target import convert_embedded

    return convert_embedded()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer, 64-dim Llama with SmolLM2's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny_target")
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_records(n: int) -> list[dict]:
    """n small conversations, some with two user turns."""
    return [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": "an answer the target will replace"},
        *([{"from": "human", "value": "And times two?"}] if i % 2 else []),
    ]} for i in range(n)]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's and vLLM's workers leave the
    launcher's process group, so killing the group is not enough); ones already gone are
    skipped."""
    import psutil

    try:
        parent = psutil.Process(pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
