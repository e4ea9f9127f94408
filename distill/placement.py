"""Which GPUs each process's stage-1 engine owns under `accelerate launch`.

Every process of a launch sees every GPU of its machine, and the launcher's variables (RANK,
WORLD_SIZE, MASTER_ADDR, ...) describe the training process group. A vLLM engine started from
such a process would take GPU 0 and read those variables as its own world. So each engine starts
with CUDA_VISIBLE_DEVICES set to its own GPUs and without the launcher's variables (its worker
processes inherit both); the process group stays the training's.

With generation.vllm_tensor_parallel_size = t and n processes on a machine of G GPUs:
- n * t <= G: every process drives an engine on GPUs [i*t, (i+1)*t) of its machine (e.g. 2
  processes with t = 4 on 8 GPUs);
- otherwise, with one process per GPU (n = G, t dividing n): the process of local index i with
  i % t == 0 drives an engine on GPUs [i, i+t) and the other t - 1 processes generate nothing
  in stage 1 (their GPUs are that engine's).
The prompts are split between engines, not processes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from recipe import ConfigError

LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
"""What torchrun (accelerate launch) sets for the training's process group."""


@dataclass(frozen=True)
class EngineSlot:
    gpus: tuple[str, ...]
    """CUDA_VISIBLE_DEVICES entries of this process's engine; () on a machine without GPUs."""
    share: int | None
    """Which share of the prompts this process's engine writes; None: it runs no engine."""
    shares: int
    """How many engines the launch runs."""


def engine_slot(process_index: int, num_processes: int, local_index: int,
                local_processes: int, tensor_parallel: int, visible: list[str]) -> EngineSlot:
    """This process's engine (torchrun numbers processes machine by machine: process_index =
    machine_rank * local_processes + local_index). visible: the machine's GPUs as
    CUDA_VISIBLE_DEVICES names them (empty on a CPU)."""
    t, n = tensor_parallel, local_processes
    if not visible:
        if t > 1 and num_processes > 1:
            raise ConfigError(
                f"generation.vllm_tensor_parallel_size={t} spreads one engine over {t} devices, "
                f"but stage 1 was launched as {num_processes} processes on a machine without "
                "GPUs, each of which would start its own: run stage 1 as one process (`python "
                "distill.py --config ... --stage distill`) or set "
                "generation.vllm_tensor_parallel_size=1.")
        return EngineSlot((), process_index, num_processes)
    if n * t <= len(visible):
        return EngineSlot(tuple(visible[local_index * t:(local_index + 1) * t]), process_index,
                          num_processes)
    if n == len(visible) and n % t == 0:
        leader = local_index % t == 0
        return EngineSlot(tuple(visible[local_index:local_index + t]) if leader else (),
                          process_index // t if leader else None, num_processes // t)
    raise ConfigError(
        f"stage 1 runs {n} processes on a machine with {len(visible)} GPUs "
        f"({','.join(visible)}) and generation.vllm_tensor_parallel_size={t}: each engine needs "
        f"{t} GPUs of its own. Launch {len(visible) // t or 1} processes per machine, or one per "
        f"GPU with a tensor-parallel size dividing {len(visible)}.")


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def slot_of(accelerator, tensor_parallel: int) -> EngineSlot:
    state = accelerator.state
    return engine_slot(state.process_index, state.num_processes, state.local_process_index,
                       _local_processes(state), tensor_parallel, visible_gpus())


def _local_processes(state) -> int:
    """Processes on this machine (torchrun's LOCAL_WORLD_SIZE; all of them without a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or state.num_processes)


ENGINE_VARIABLES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
"""vLLM's engine in processes of its own (an engine in this process would use this process's
CUDA context, which is on the accelerator's GPU), started by spawn (CUDA is initialised here)."""


@contextlib.contextmanager
def engine_environment(gpus: tuple[str, ...]):
    """Within: CUDA_VISIBLE_DEVICES = gpus and none of the launcher's variables, so an engine
    started here (and every worker process it spawns) sees its GPUs and a world of its own.
    Restored after. Nothing changes on a machine without GPUs (gpus empty)."""
    if not gpus:
        yield
        return
    names = ("CUDA_VISIBLE_DEVICES", *LAUNCHER_VARIABLES, *ENGINE_VARIABLES)
    saved = {name: os.environ.get(name) for name in names}
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(ENGINE_VARIABLES, CUDA_VISIBLE_DEVICES=",".join(gpus))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
