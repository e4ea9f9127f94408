"""The device check: the device tier's tests, then throughput probes, on one accelerator.

    python -m benchmarks.gpu_check --device cuda --out gpu-check      # on a GPU (bf16)
    .venv/bin/python -m benchmarks.gpu_check --device cpu --out gpu-check   # here (fp32, small)

It runs `pytest -m gpu --device DEVICE` (tests/gpu: greedy equality and the sampling
chi-square for every draft kind and trees, a bf16-autocast training step per kind, the
predicted-acceptance maths, a 1-process DDP step), then on random-weight targets created on the
device (nothing is downloaded; the figures are speeds, not quality) in the embedded target's
shape (SmolLM2-135M) and, on a GPU, a ~1B Llama-3.2 shape:
- generation: our engine's plain greedy decoding, tokens/s at batch 1 and batch 16;
- verification: ms of one target forward over 1..9 new tokens after a 256-token context, and
  over token trees by node count (the chain plus w alternatives per position);
- engine: tokens/s with no draft and with the target drafting for itself (k = 4, every draft
  accepted: tau = k + 1), next to the bound a free perfect draft would give on this hardware
  ((k + 1) x the 1-token forward / the (k + 1)-token forward);
- training: tokens/s of each draft kind's training step (the loop's micro-step: target
  features and logits, the draft's forward, loss, backward, AdamW), under bf16 autocast on a
  GPU.
Timing synchronises the device around every measured call. It writes DIR/gpu_check.json and
DIR/gpu_check.md (the table, printed too) and exits 1 if a test failed. Its imports are what
the GPU machine has (torch, transformers, accelerate, peft, safetensors, pyarrow): no
datasets, vLLM, DeepSpeed or gguf.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     tie_word_embeddings=True, rope_theta=500000.0),
}
"""Target shapes (LlamaConfig fields): 'tiny' for the check's own test, the embedded target's,
and Llama-3.2-1B's."""

TRAIN_KINDS = {
    "independent": ["train.draft=layer-truncated:1"],
    "medusa": ["train.draft=medusa:3x1"],
    "eagle3": ["train.draft=eagle3", "train.eagle3.ttt_steps=3"],
    "dflash": ["train.draft=dflash", "train.block_size=3"],
    "pard": ["train.draft=pard:layer-truncated:1", "train.block_size=3", "train.block_starts=4"],
}
"""Each draft kind as the training probe (and the device tier's training test) builds it."""


def kind_overrides(kind: str, target_config) -> list[str]:
    """TRAIN_KINDS[kind] fitted to a target: aux layers a shallow target has (vLLM's default
    needs 6 layers), a draft vocabulary of at most half the target's."""
    layers, vocab = target_config.num_hidden_layers, target_config.vocab_size
    extra = []
    if kind in ("eagle3", "dflash") and layers < 6:
        aux = [0, layers // 2, layers - 1] if kind == "eagle3" else [layers - 1]
        extra.append(f"train.aux_layers=[{','.join(map(str, aux))}]")
    if kind == "eagle3":
        extra.append(f"train.draft_vocab_size={min(8192, vocab // 2)}")
    if kind in ("dflash", "pard"):  # the last id: training_examples never writes it
        extra.append(f"train.mask_token_id={vocab - 1}")
    return TRAIN_KINDS[kind] + extra


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of fn() over repeats calls after one warm-up, the device synchronised."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_target(shape: str, device: torch.device, dtype: torch.dtype):
    """A random-weight Llama of the shape, made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, **SHAPES[shape])
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def random_ids(vocab: int, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g)


# --- training --------------------------------------------------------------------------------

class _Ids:
    """What building a draft asks of a tokenizer when the mask token is given: its spelling."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return f"<{token_id}>"


def training_steps(kind_overrides: list[str], target, examples: list, accelerator,
                   steps: int) -> dict:
    """steps optimizer steps of the training loop's own step (train.loop.step_on_batches:
    target features and logits, the draft's forward, the weighted loss, backward, clip, AdamW)
    on one batch of examples under the accelerator (its device and mixed precision) ->
    {"losses" (per loss token), "grad_norms" (before clipping, which is off), "seconds" (after
    the first step), "tokens" (per step)}."""
    from recipe import load_config
    from train.data import collate
    from train.loop import (
        Dist,
        TargetSignal,
        TrainState,
        _unwrap,
        check_train_config,
        step_on_batches,
    )

    cfg = load_config(ROOT / "configs" / "smollm2-135m-independent.yaml", [
        *kind_overrides, "train.loss=0.5*fkl+0.5*ce", "train.target_features=online",
        "train.target_logits=online", "train.eval_k=3", "train.feature_noise=0",
        "train.gradient_accumulation_steps=1", "train.max_grad_norm=1e9",
        f"train.mixed_precision={accelerator.mixed_precision}"])
    tcfg = cfg.train
    kind = check_train_config(tcfg)
    torch.manual_seed(0)
    draft = kind.build(tcfg, target, _Ids(), examples, lambda *a: None)
    kind.freeze(draft, tcfg)
    model = kind.wrap(draft, tcfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    signal = TargetSignal.for_run(cfg, target, _unwrap(model), accelerator.autocast)
    batch = collate(examples, 0, max(len(e.input_ids) for e in examples)).to(accelerator.device)
    dist, state = Dist.of(accelerator), TrainState()
    losses, norms, seconds = [], [], 0.0
    for step in range(steps):
        sync(accelerator.device)
        start = time.perf_counter()
        loss_sum, tokens, norm = step_on_batches(cfg, accelerator, dist, model, optimizer,
                                                 [batch], signal, state)
        losses.append(loss_sum / tokens)
        norms.append(float(norm))
        sync(accelerator.device)
        if step > 0:
            seconds += time.perf_counter() - start
    return {"losses": losses, "grad_norms": norms, "seconds": seconds,
            "tokens": int(batch.attention_mask.sum())}


def training_examples(vocab: int, rows: int, length: int) -> list:
    """Random conversations: a prompt of length/4 tokens, the rest the reply (loss on it)."""
    from train.data import Example

    ids = random_ids(vocab - 1, rows, length, seed=1)  # the last id stays the mask token
    prompt = length // 4
    return [Example(str(i), ids[i].tolist(), [0] * prompt + [1] * (length - prompt))
            for i in range(rows)]


# --- probes ----------------------------------------------------------------------------------

def probe_generation(target, device, new_tokens: int) -> dict:
    from decoding.engine import DecodeSettings, generate

    vocab = target.config.vocab_size
    found = {}
    for batch in (1, 16):
        ids = random_ids(vocab, batch, 128).to(device)
        mask = torch.ones_like(ids)
        settings = DecodeSettings(max_new_tokens=new_tokens)
        seconds = timed(device, lambda: generate(target, ids, mask, settings, set()), 2)
        found[f"batch_{batch}_tokens_per_s"] = batch * new_tokens / seconds
    return found


def probe_verification(target, device, repeats: int, tree_depth: int = 4,
                       widths: int = 4) -> dict:
    """ms of one forward over 1..9 new tokens, and over trees, after a 256-token context."""
    from decoding.kv import CachedLM
    from decoding.tree import ancestor_mask, build_tree

    vocab = target.config.vocab_size
    context = random_ids(vocab, 1, 256).to(device)
    new = random_ids(vocab, 1, 16, seed=2).to(device)
    chain_ms = {}
    for n in range(1, 10):
        def forward(n=n):
            lm = CachedLM(target)
            lm.prefill(context, torch.ones_like(context))
            sync(device)
            start = time.perf_counter()
            lm.extend(new[:, :n], torch.ones(1, n, dtype=torch.bool, device=device))
            sync(device)
            return time.perf_counter() - start
        forward()
        chain_ms[n] = 1000 * statistics.median(forward() for _ in range(repeats))
    tree_ms = {}
    g = torch.Generator().manual_seed(0)
    for width in range(widths + 1):
        alternatives = torch.randint(3, vocab, (1, tree_depth, width), generator=g).to(device)
        tree = build_tree(new[:, 0], new[:, 1:tree_depth + 1], alternatives if width else None)
        seen = ancestor_mask(tree.parents)

        def forward_tree(tree=tree, seen=seen):
            lm = CachedLM(target)
            lm.prefill(context, torch.ones_like(context))
            sync(device)
            start = time.perf_counter()
            lm.extend_tree(tree.tokens, tree.depth, seen, tree.valid)
            sync(device)
            return time.perf_counter() - start
        forward_tree()
        tree_ms[int(tree.size)] = 1000 * statistics.median(forward_tree() for _ in range(repeats))
    return {"chain_ms": chain_ms, "tree_ms": tree_ms}


def probe_engine(target, device, new_tokens: int, k: int, chain_ms: dict) -> dict:
    """Batch-1 tokens/s with no draft and with the target drafting for itself."""
    from decoding.engine import DecodeSettings, generate
    from drafts.independent import ModelDraft

    ids = random_ids(target.config.vocab_size, 1, 128).to(device)
    mask = torch.ones_like(ids)
    plain_s = timed(device, lambda: generate(target, ids, mask,
                                             DecodeSettings(max_new_tokens=new_tokens), set()), 2)
    result = {}

    def self_drafted():
        result["out"] = generate(target, ids, mask, DecodeSettings(max_new_tokens=new_tokens, k=k),
                                 set(), ModelDraft(target))
    self_s = timed(device, self_drafted, 2)
    stats = result["out"].stats
    tau = sum(s.accepted for s in stats) / max(sum(s.steps for s in stats), 1) + 1
    return {"no_draft_tokens_per_s": new_tokens / plain_s,
            "self_draft_tokens_per_s": new_tokens / self_s, "self_draft_tau": tau, "k": k,
            "free_perfect_draft_bound_x": (k + 1) * chain_ms[1] / chain_ms[k + 1]}


def probe_training(target, device, precision: str, rows: int, length: int, steps: int) -> dict:
    from accelerate import Accelerator

    from train.loop import reset_accelerate

    found = {}
    examples = training_examples(target.config.vocab_size, rows, length)
    for kind in TRAIN_KINDS:
        reset_accelerate()
        accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision)
        run = training_steps(kind_overrides(kind, target.config), target, examples, accelerator,
                             steps)
        found[kind] = {"tokens_per_s": run["tokens"] * (steps - 1) / run["seconds"],
                       "final_loss": run["losses"][-1]}
    reset_accelerate()
    return found


# --- the check -------------------------------------------------------------------------------

def run_tests(device: str, out: Path, timeout_s: int, tests: tuple = ("tests/gpu",)) -> dict:
    """pytest -m gpu --device device on the device tier -> counts from its JUnit XML."""
    xml = out / "tests.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", *tests, "-m", "gpu", "--device",
                           device, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    (out / "tests.log").write_text(done.stdout + done.stderr)
    if not xml.is_file():
        return {"exit_code": done.returncode, "error": (done.stdout + done.stderr)[-2000:]}
    suite = ElementTree.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"exit_code": done.returncode, **counts, "seconds": float(suite.get("time", 0.0)),
            "failed": failed}


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"{torch.cuda.get_device_name(device)} (compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}, "
                f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB)")
    from decoding.packed import cpu_model
    from train.loop import cpu_has_native_bf16

    return (f"{cpu_model()}, {torch.get_num_threads()} threads, "
            f"{'native bf16 (AVX512-BF16/AMX)' if cpu_has_native_bf16() else 'no native bf16'}")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or "unknown"


def markdown(report: dict) -> str:
    lines = [f"# Device check: {report['hardware']}", "",
             f"torch {report['torch']}, commit {report['commit']}, dtype {report['dtype']}, "
             f"`{report['command']}`; random-weight targets made on the device (speeds only).", ""]
    tests = report.get("tests")
    if tests is not None:
        failed = tests.get("failures", 0) + tests.get("errors", 0)
        passed = tests.get("tests", 0) - failed - tests.get("skipped", 0)
        lines += [f"Device tier (pytest -m gpu): {passed} passed, {failed} failed, "
                  f"{tests.get('skipped', 0)} skipped ({tests.get('seconds', 0):.0f} s)"
                  + (f"; failed: {', '.join(tests['failed'])}" if tests.get("failed") else ""),
                  ""]
    for shape, found in report["shapes"].items():
        lines += [f"## {shape}", "", "| probe | value |", "|---|---|"]
        for key, value in found["generation"].items():
            lines.append(f"| generation, {key.replace('_', ' ')} | {value:.1f} |")
        chain = found["verification"]["chain_ms"]
        lines.append("| verification ms, 1..9 tokens | "
                     + " / ".join(f"{chain[n]:.2f}" for n in sorted(chain)) + " |")
        trees = found["verification"]["tree_ms"]
        lines.append("| verification ms, trees by nodes | "
                     + " / ".join(f"{n}: {trees[n]:.2f}" for n in sorted(trees)) + " |")
        engine = found["engine"]
        lines += [f"| engine tokens/s, no draft | {engine['no_draft_tokens_per_s']:.1f} |",
                  f"| engine tokens/s, target drafting for itself (k={engine['k']}, tau "
                  f"{engine['self_draft_tau']:.2f}) | {engine['self_draft_tokens_per_s']:.1f} |",
                  f"| speedup bound of a free perfect draft, k={engine['k']} | "
                  f"{engine['free_perfect_draft_bound_x']:.2f}x |",
                  "| engine tokens/s, trained draft | none for a random-weight target |"]
        for kind, train in found["training"].items():
            lines.append(f"| training tokens/s, {kind} | {train['tokens_per_s']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", required=True, help="cuda, cuda:1, ... or cpu")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated, of {', '.join(SHAPES)} (default: smollm2-135m "
                             "and llama-1b on a GPU, smollm2-135m on a CPU)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the targets' dtype and training's autocast (default bfloat16 on a "
                             "GPU, float32 on a CPU)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=4)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    gpu = device.type != "cpu"
    shapes = (args.shapes or ("smollm2-135m,llama-1b" if gpu else "smollm2-135m")).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose among {list(SHAPES)}")
    dtype_name = args.dtype or ("bfloat16" if gpu else "float32")
    dtype = getattr(torch, dtype_name)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"hardware": hardware(device), "torch": torch.__version__, "commit": commit(),
              "dtype": dtype_name, "command": "python -m benchmarks.gpu_check " + " ".join(
                  sys.argv[1:] if argv is None else argv), "shapes": {}}
    started = time.perf_counter()
    if not args.skip_tests:
        report["tests"] = run_tests(args.device, args.out, timeout_s=480)
        print(f"[gpu_check] device tier: {report['tests']}", flush=True)
    precision = "bf16" if dtype == torch.bfloat16 else "no"
    for shape in shapes:
        target = random_target(shape, device, dtype)
        found = {"generation": probe_generation(target, device, args.new_tokens)}
        found["verification"] = probe_verification(target, device, args.repeats)
        found["engine"] = probe_engine(target, device, args.new_tokens, 4,
                                       found["verification"]["chain_ms"])
        training_target = target if dtype == torch.float32 else target.float()
        found["training"] = probe_training(training_target, device, precision, rows=8,
                                           length=256, steps=args.train_steps)
        report["shapes"][shape] = found
        print(f"[gpu_check] {shape}: {json.dumps(found)}", flush=True)
        del target, training_target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "gpu_check.md").write_text(table + "\n")
    print(table)
    tests = report.get("tests") or {}
    return 1 if tests.get("exit_code") else 0


if __name__ == "__main__":
    sys.exit(main())
