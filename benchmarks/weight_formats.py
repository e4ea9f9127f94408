"""Benchmark: what one drafted token's matrix products cost per weight format, on this CPU.

    .venv/bin/python -m benchmarks.weight_formats [--layers 6] [--vocab 8192] [--repeats 50]
        [--draft <folder> [--tokens 512]]

An independent draft's token is its layers' products (q/k/v one product, o, gate/up one, down)
and its head's (--vocab rows); their cost bounds how cheap a draft step can get. This takes
those matrices from the embedded target (its first --layers layers, the first --vocab rows of
its head), one token's activations, and times the products alone (no attention, norms or
Python between them: drafts/slot_lm.py adds those) in each weight format: fp32, bf16, fp16
(torch's matmul), and on bf16 activations int8 per output row and int4 in groups of 32
(decoding/quantise.py's Int8Linear and Int4Linear: eval.draft_weights=int8 and int4).
"warm": the pass repeated, its weights in cache where they fit; "cold": a 256 MB buffer
swept before each pass, as a target forward evicts the draft's weights between draft steps.
Medians in ms per pass.

--draft <folder> (a trained independent or PARD draft: an LM of its own) adds what each
quantised format does to that draft: over the first --tokens tokens of the MT-bench questions,
how often the quantised draft's greedy next token is its fp32 self's, and the mean KL divergence
of its next-token distribution from the fp32 one's. Acceptance follows that agreement: measure
a format here before drafting on it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from assets.chat import render
from assets.prompts import load_mtbench
from assets.target import load_target, resolve_target
from decoding.quantise import Int4Linear, Int8Linear, quantised_copy
from recipe import ModelConfig


def draft_matrices(target, layers: int, vocab: int) -> list[torch.Tensor]:
    """The fp32 weights [N, K] one drafted token multiplies: per layer qkv, o, gate_up, down;
    then the head's first vocab rows."""
    out = []
    for layer in target.model.layers[:layers]:
        attn, mlp = layer.self_attn, layer.mlp
        out += [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight]
    return [w.detach().float().contiguous() for w in out] + [
        target.get_output_embeddings().weight[:vocab].detach().float().contiguous()]


def products(weights: list[torch.Tensor], form: str):
    """The token's products in one format -> (a function of the activations per K, their
    dtype)."""
    if form in ("fp32", "bf16", "fp16"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[form]
        cast = [w.to(dtype) for w in weights]
        return [lambda x, w=w: x @ w.t() for w in cast], dtype
    form = {"int8": Int8Linear, "int4": Int4Linear}[form]
    return [form.quantise(w) for w in weights], torch.bfloat16


@torch.no_grad()
def agreement(model, ids: torch.Tensor, weights: str) -> tuple[float, float]:
    """An LM and token ids [1, T] -> (share of positions whose greedy next token the model on
    quantised weights keeps, mean KL(fp32 || quantised) per position in nats)."""
    exact = model(ids).logits.float().log_softmax(-1)  # [1, T, V]
    quantised = quantised_copy(model, weights)(ids).logits.float().log_softmax(-1)
    kept = (quantised.argmax(-1) == exact.argmax(-1)).float().mean().item()
    kl = (exact.exp() * (exact - quantised)).sum(-1).mean().item()
    return kept, kl


def draft_agreement(folder: str, tokens: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = []
    for conversation in load_mtbench()[0]:
        ids += render(tokenizer, [{"role": "user", "content": conversation.user_turns[0]}], True)
        if len(ids) >= tokens:
            break
    ids = torch.tensor([ids[:tokens]])
    print(f"\n{folder}: {ids.shape[1]} tokens of MT-bench questions, each format against the "
          "draft's fp32 self\n| format | greedy next token kept | mean KL (nats) |\n|---|---|---|")
    for weights in ("int8", "int4"):
        kept, kl = agreement(model, ids, weights)
        print(f"| {weights} | {kept:.3f} | {kl:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--draft", help="a trained independent or PARD draft's folder")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    target = load_target(resolve_target(ModelConfig()), "float32", torch.device("cpu"))
    weights = draft_matrices(target, args.layers, args.vocab)
    del target
    megabytes = sum(w.numel() for w in weights) / 1e6
    sweep = torch.zeros(64_000_000)  # 256 MB: evicts any cache
    print(f"one token through {args.layers} layers and a {args.vocab}-row head: "
          f"{len(weights)} products, {megabytes:.1f} M weights; torch threads "
          f"{torch.get_num_threads()}; medians of {args.repeats}")
    print("| format | weight MB | warm ms | cold ms |\n|---|---|---|---|")
    for form, width in (("fp32", 4), ("bf16", 2), ("fp16", 2), ("int8", 1), ("int4", 0.5)):
        fns, dtype = products(weights, form)
        inputs = [torch.randn(1, w.shape[1]).to(dtype) for w in weights]

        def run():
            start = time.perf_counter()
            for fn, x in zip(fns, inputs):
                fn(x)
            return (time.perf_counter() - start) * 1e3

        for _ in range(5):
            run()
        warm = statistics.median(run() for _ in range(args.repeats))
        cold = []
        for _ in range(args.repeats):
            sweep.add_(1.0)
            cold.append(run())
        print(f"| {form} | {megabytes * width:.0f} | {warm:.2f} | {statistics.median(cold):.2f} |")
    if args.draft:
        draft_agreement(args.draft, args.tokens)


if __name__ == "__main__":
    main()
