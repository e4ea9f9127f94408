"""The prompts a run is measured on (eval.prompts): the run's held-out conversations from stage
1, MT-bench, or a file, each first user turn in the target's chat template. eval measures on
them and serving.validate compares engines on the very same."""

from __future__ import annotations

import json
from pathlib import Path

from assets.chat import render
from assets.prompts import Conversation, load_file, load_mtbench
from recipe import Config, ConfigError
from runfolder.paths import run_folder
from runfolder.shards import load_distilled


def across_categories(conversations: list[Conversation], n: int | None,
                      tune: bool = False) -> list[Conversation]:
    """n conversations taking each category in turn (in the order categories first appear), each
    time its next question of even index within the category (odd with tune: a disjoint split).
    MT-bench lists its 80 questions category by category, so its first n are all 'writing'."""
    by_category: dict[str | None, list[Conversation]] = {}
    for conv in conversations:
        by_category.setdefault(conv.category, []).append(conv)
    if None in by_category:
        raise ConfigError("eval.prompt_pick draws across categories, but some prompts have no "
                          "category: use eval.prompt_pick=first.")
    queues = [group[int(tune)::2] for group in by_category.values()]
    picked = []
    for turn in range(max(map(len, queues))):
        picked += [queue[turn] for queue in queues if turn < len(queue)]
    return picked[:n]


def load_eval_prompts(cfg: Config, tokenizer, context: int | None) -> tuple[list[list[int]], int]:
    """The eval prompts in the chat template, and how many were skipped as too long for the
    target's context together with eval.max_new_tokens."""
    ev = cfg.eval
    if ev.prompts == "mtbench":
        conversations, _ = load_mtbench()
    elif ev.prompts == "held_out":
        rows = load_distilled(run_folder(cfg).root).get("held_out")
        if rows is None or len(rows) == 0:
            raise ConfigError("eval.prompts=held_out but the stage-1 output has no held-out "
                              "conversations: run the distill stage (data.held_out_fraction > 0).")
        conversations = []
        for row in rows:
            messages = json.loads(row["messages"])
            first_user = next(m["content"] for m in messages if m["role"] == "user")
            conversations.append(Conversation(row["id"], "held_out", [first_user]))
    else:
        conversations, _ = load_file(Path(ev.prompts).expanduser())
    if not conversations:
        raise ConfigError(f"eval.prompts={ev.prompts!r} holds no prompt.")
    if ev.prompt_pick == "first":
        conversations = conversations[: ev.num_prompts]
    else:
        conversations = across_categories(conversations, ev.num_prompts,
                                          tune=ev.prompt_pick == "categories-tune")
    prompts, skipped = [], 0
    for conv in conversations:
        ids = render(tokenizer, conv.first_turn(), add_generation_prompt=True)
        # the last step verifies up to k (or k_max) draft positions past the last token
        if context is not None and len(ids) + ev.max_new_tokens + ev.k_max_used > context:
            skipped += 1
        else:
            prompts.append(ids)
    if not prompts:
        raise ConfigError(f"all {len(conversations)} eval prompts exceed the target's context "
                          f"({context}) with eval.max_new_tokens={ev.max_new_tokens}: lower it.")
    return prompts, skipped
