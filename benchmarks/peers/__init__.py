"""The field's trainers that benchmarks/side_by_side.py runs beside ours: each peer's pinned
venv, how a peer's entry script runs, what every peer's run shares with ours, and the target's
features as every peer's data format holds them. One module per peer holds its adapter
(speculators.py, specforge.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

PEERS = {"speculators": "speculators==0.9.0", "specforge": "specforge==0.2.0"}

PEER_ENTRY = {"speculators": ROOT / "benchmarks" / "peer_entry" / "speculators_cpu.py",
              "specforge": ROOT / "benchmarks" / "peer_entry" / "specforge_cpu.py"}

# speculators runs on our torch (the CPU wheel); SpecForge pins torch 2.11.0, whose PyPI wheel
# (built for CUDA, with its libraries: most of the venv's ~11 GB) runs on a CPU as well
CPU_TORCH = {"speculators": True, "specforge": False}

SHARED_MATCHED = [
    "stage-1 conversations, their train / held-out split (by id) and truncation to max_seq_len",
    "target features: one transformers forward, fp32, stored in bf16 by both",
]

SHARED_TAIL = [
    "AdamW, the recipe's peak learning rate, its warmup steps, cosine decay, no weight decay, "
    "gradients clipped at norm 1",
    "bf16 autocast where the CPU runs it natively (the recipe's mixed_precision: auto)",
]

SHARED_UNMATCHED = [
    "batches: ours takes micro_batch_size conversations per optimizer step; speculators packs "
    "conversations into a token budget per step (--total-seq-len), set to micro_batch_size times "
    "the mean training conversation's length, so tokens per step match on average and the step "
    "counts differ a little",
    "the cosine floor: ours decays to learning_rate * min_lr_ratio, speculators' to 0",
    "speculators saves its checkpoints in bf16, ours in fp32",
    "precision where the CPU runs bf16 natively: speculators is passed --hidden-states-dtype "
    "bfloat16, under which its trainer casts the whole draft to bf16 (bf16 master weights); "
    "ours keeps fp32 weights under bf16 autocast",
]


def peer_python(peer: str, log=print) -> Path:
    """The python of the peer's own venv, made once. speculators: torch 2.13.0 (the CPU wheel
    on disk) first, the pinned peer with torch held to it, then without PyPI's CUDA torchvision
    / torchaudio / torchcodec, which break `import transformers` beside the CPU torch.
    SpecForge: the pinned peer with the torch it pins."""
    from recipe import cache_root

    spec = PEERS[peer]
    venv = cache_root() / "peers" / spec.replace("==", "-")
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.is_file():
        return python
    log(f"[side-by-side] installing {spec} into {venv} (once)")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    if CPU_TORCH[peer]:
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text("torch==2.13.0\n")
        subprocess.run([*pip, "-c", str(constraints), spec], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=False)
    else:
        subprocess.run([*pip, spec], check=True)
    subprocess.run([str(python), "-c", f"import {peer}, transformers"], check=True)
    stamp.write_text(spec + "\n")
    return python


def run_peer(peer: str, python: Path, args: list[str], log_path: Path, what: str,
             env: dict | None = None) -> float:
    """One run of the peer's entry point (benchmarks/peer_entry) in its venv, with our torch
    threads and `env`, its output appended to log_path: its wall seconds. A failure raises
    with the end of its log."""
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": str(torch.get_num_threads()),
           **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log_path.open("a") as log:
        done = subprocess.run([str(python), str(PEER_ENTRY[peer]), *args], env=env,
                              cwd=log_path.parent, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}); its log {log_path} "
                           f"ends:\n{tail}")
    return seconds


@torch.no_grad()
def layer_features(target, input_ids: list[int], aux_layers: list[int]) -> torch.Tensor:
    """[T, len(aux_layers) + 1, H]: the inputs of the aux decoder layers (HF hidden_states
    indices) and the last decoder layer's output before the final norm, what speculators
    stores (the norm and lm_head give the target's logits from it)."""
    decoder = target.get_decoder()
    last = {}
    hook = decoder.layers[-1].register_forward_hook(
        lambda module, args, output: last.setdefault("h", output[0] if isinstance(output, tuple)
                                                      else output))
    try:
        out = decoder(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        hook.remove()
    layers = [out.hidden_states[i][0] for i in aux_layers] + [last["h"][0]]
    return torch.stack(layers, dim=1)
