"""Stage-1 engines under `accelerate launch`: which GPUs each process's engine owns, which share
of the prompts it writes, and the environment its engine starts in (no GPU needed: the launch
shapes are given, the engine is a recording fake)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from distill.generate import VLLMGenerator
from distill.placement import LAUNCHER_VARIABLES, engine_environment, engine_slot
from recipe import ConfigError, GenerationConfig

EIGHT = [str(g) for g in range(8)]


def _launch(machines: int, per_machine: int, tensor_parallel: int, visible: list[str]):
    return [engine_slot(m * per_machine + i, machines * per_machine, i, per_machine,
                        tensor_parallel, visible)
            for m in range(machines) for i in range(per_machine)]


def test_one_process_per_gpu_drives_an_engine_on_its_own_gpu():
    slots = _launch(1, 8, 1, EIGHT)
    assert [s.gpus for s in slots] == [(g,) for g in EIGHT]
    assert [s.share for s in slots] == list(range(8)) and {s.shares for s in slots} == {8}


def test_tensor_parallel_engines_are_driven_by_every_t_th_process():
    slots = _launch(1, 8, 2, EIGHT)
    assert [s.gpus for s in slots] == [("0", "1"), (), ("2", "3"), (), ("4", "5"), (),
                                       ("6", "7"), ()]
    assert [s.share for s in slots] == [0, None, 1, None, 2, None, 3, None]
    assert {s.shares for s in slots} == {4}


def test_fewer_processes_than_gpus_give_each_engine_t_gpus():
    slots = _launch(1, 2, 4, EIGHT)
    assert [s.gpus for s in slots] == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert [s.share for s in slots] == [0, 1]


@pytest.mark.parametrize("machines,per_machine,t", [(2, 8, 1), (2, 8, 2), (2, 8, 4), (3, 8, 8),
                                                     (2, 2, 4), (1, 4, 1)])
def test_the_engines_shares_cover_the_prompts_once(machines, per_machine, t):
    slots = _launch(machines, per_machine, t, EIGHT)
    shares = [s.share for s in slots if s.share is not None]
    assert sorted(shares) == list(range(slots[0].shares))
    for m in range(machines):  # on each machine no GPU belongs to two engines
        gpus = [g for s in slots[m * per_machine:(m + 1) * per_machine] for g in s.gpus]
        assert len(gpus) == len(set(gpus)) and all(len(s.gpus) in (0, t) for s in slots)


def test_the_gpus_are_named_as_cuda_visible_devices_lists_them():
    slots = _launch(1, 2, 2, ["4", "5", "6", "7"])
    assert [s.gpus for s in slots] == [("4", "5"), ("6", "7")]


def test_a_launch_whose_engines_cannot_have_gpus_of_their_own_is_refused():
    with pytest.raises(ConfigError, match=r"3 processes on a machine with 4 GPUs.*Launch 2"):
        engine_slot(0, 3, 0, 3, 2, ["0", "1", "2", "3"])
    with pytest.raises(ConfigError, match="without GPUs"):
        engine_slot(0, 2, 0, 2, 2, [])
    assert engine_slot(1, 2, 1, 2, 1, []).share == 1  # CPU: one engine per process


def test_the_engine_environment_hides_the_launch_and_is_restored(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with engine_environment(("2", "3")):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
        assert not set(LAUNCHER_VARIABLES) & set(os.environ)
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "29500"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with engine_environment(()):  # a CPU: nothing changes
        assert os.environ["RANK"] == "3"


def test_the_vllm_engine_starts_on_its_gpus_outside_the_process_group(monkeypatch, tiny_target):
    seen = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(env=dict(os.environ), kwargs=kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    target = types.SimpleNamespace(path=str(tiny_target), revision=None)
    tokenizer = types.SimpleNamespace(eos_token_id=0, convert_tokens_to_ids=lambda t: 0)
    VLLMGenerator(target, tokenizer, "bfloat16", GenerationConfig(), torch.device("cuda", 5),
                  2048, gpus=("5",))
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5"
    assert "RANK" not in seen["env"] and "WORLD_SIZE" not in seen["env"]
    assert seen["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["RANK"] == "5"
