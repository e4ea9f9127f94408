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
    conversations = conversations[: ev.num_prompts]
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
