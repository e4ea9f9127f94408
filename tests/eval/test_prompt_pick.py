"""Eval prompts drawn across MT-bench's categories, and the disjoint split to tune on."""

import pytest

from assets.prompts import Conversation, load_mtbench
from recipe import ConfigError, EvalConfig
from runfolder.prompts import across_categories


def test_mtbench_is_drawn_category_by_category_on_disjoint_splits():
    conversations, _ = load_mtbench()
    report = across_categories(conversations, 20)
    tune = across_categories(conversations, 20, tune=True)
    categories = [c.category for c in report]
    assert len(set(categories[:8])) == 8  # the first 8 cover every category
    assert categories[8:16] == categories[:8] and len(report) == 20
    assert not {c.id for c in report} & {c.id for c in tune}
    assert [c.category for c in tune] == categories
    assert len(across_categories(conversations, None)) == 40


def test_prompts_without_a_category_are_refused():
    conversations = [Conversation(f"x:{i}", "x", ["hi"]) for i in range(3)]
    with pytest.raises(ConfigError, match="no category"):
        across_categories(conversations, 2)


def test_category_pick_of_a_file_is_refused():
    with pytest.raises(ConfigError, match="eval.prompt_pick"):
        EvalConfig(prompts="prompts.jsonl", prompt_pick="categories")
