"""Benchmark: trained EAGLE-3 heads re-scored on one run's held-out conversations.

    .venv/bin/python -m benchmarks.held_out_walk --config configs/smollm2-135m-eagle3-large.yaml \
        --drafts DIR [DIR ...] [--all-held-out | --replies RESULTS] [section.key=value ...]

Prints, per head (a trained draft folder, e.g. <run>/train/draft), the training loop's held-out
figures on the run's train.eval_conversations held-out conversations (or all with
--all-held-out): loss, the greedy tau averaged over every start position (greedy_tau), and the
greedy tau a chain engine realises stepping through the same replies (walk_tau), with their
alpha_1. Heads trained on other stage-1 data of the same target are scored on this run's
conversations all the same, so a table of heads compares like with like. The target's features
are computed in fp32 here, not read from the run's offline cache.

--replies <eval folder>/results.json scores the replies an eval wrote instead (its target
method's texts on its prompts, eval.prompts and eval.num_prompts as that eval had them): there
walk_tau is what that eval measured for a greedy chain of k = train.eval_k with the same head.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import torch

    from assets.target import load_target, load_tokenizer, resolve_target
    from drafts.eagle3 import Eagle3ForTraining, Eagle3Head
    from recipe import load_config
    from train.data import held_out_batches, load_stage1
    from train.features import target_hidden
    from train.loop import evaluate_held_out

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--drafts", nargs="+", required=True, help="trained EAGLE-3 head folders")
    parser.add_argument("--all-held-out", action="store_true",
                        help="every held-out conversation, not train.eval_conversations")
    parser.add_argument("--replies", metavar="RESULTS",
                        help="an eval's results.json: score its target's replies instead")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides + (["train.eval_conversations=null"]
                                                if args.all_held_out else []))
    device = torch.device("cpu")
    resolved = resolve_target(cfg.model)
    tokenizer = load_tokenizer(resolved, cfg.model.chat_template_kwargs)
    target = load_target(resolved, cfg.model.dtype, device)
    if args.replies:
        batches, where = replies_batches(cfg, tokenizer, Path(args.replies)), args.replies
    else:
        batches = held_out_batches(load_stage1(cfg, resolved.fingerprint), cfg,
                                   tokenizer.pad_token_id)
        where = f"held-out conversations of {cfg.run.name}"
    print(f"{sum(len(b.ids) for b in batches)} {where}, "
          f"k = {cfg.train.eval_k}, {cfg.model.dtype}\n\n"
          "| head | held-out loss | greedy_tau (alpha_1) | walk_tau (alpha_1) |\n|---|---|---|---|")
    for folder in args.drafts:
        head = Eagle3Head.from_pretrained(folder, torch.float32, device).eval()
        model = Eagle3ForTraining(head, cfg.train.eagle3.ttt_steps, cfg.train.position_decay)
        r = evaluate_held_out(model, target, batches, cfg.train, device,
                              lambda batch, head=head: target_hidden(target, batch,
                                                                      head.aux_layers))
        print(f"| {folder} | {r['loss']:.3f} | {r['greedy_tau']:.3f} ({r['greedy_alpha'][0]:.3f}) "
              f"| {r['walk_tau']:.3f} ({r['walk_alpha'][0]:.3f}) |", flush=True)


def replies_batches(cfg, tokenizer, results: Path) -> list:
    """The target's replies in an eval's results.json, after the prompts they answered, one
    conversation per batch (the loss and the walk on the reply tokens)."""
    from recipe import ConfigError
    from runfolder.prompts import load_eval_prompts
    from train.data import Example, collate

    texts = json.loads(results.read_text())["methods"].get("target", {}).get("texts")
    if not texts:
        raise ConfigError(f"{results} holds no target texts: measure with the target among "
                          "eval.methods.")
    prompts, _ = load_eval_prompts(cfg, tokenizer, None)
    if len(prompts) != len(texts):
        raise ConfigError(f"{results} answers {len(texts)} prompts, eval.prompts="
                          f"{cfg.eval.prompts} with eval.num_prompts={cfg.eval.num_prompts} "
                          f"gives {len(prompts)}: pass the overrides that eval ran with.")
    batches = []
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        reply = tokenizer.encode(text, add_special_tokens=False)
        example = Example(str(i), list(prompt) + reply, [0] * len(prompt) + [1] * len(reply))
        batches.append(collate([example], tokenizer.pad_token_id, len(example.input_ids)))
    return batches


if __name__ == "__main__":
    main()
