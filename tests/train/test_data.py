"""Micro-batches: deterministic order, label alignment, truncation with top-k rows."""

import torch

from train.data import Example, collate, is_on_policy, micro_batch_examples, prompt_of, truncate


def _examples(n):
    return [Example(f"e{i}", list(range(10 + i)), [0] * 5 + [1] * (5 + i)) for i in range(n)]


def test_order_is_a_function_of_the_micro_batch_number_and_covers_each_epoch():
    data = _examples(7)
    first = [micro_batch_examples(data, p, 2, seed=3) for p in range(3)]  # 3 full batches/epoch
    again = [micro_batch_examples(data, p, 2, seed=3) for p in range(3)]
    assert [[e.id for e in b] for b in first] == [[e.id for e in b] for b in again]
    ids = [e.id for b in first for e in b]
    assert len(set(ids)) == 6  # no repeats inside an epoch (one example left over)
    next_epoch = [e.id for p in range(3, 6) for e in micro_batch_examples(data, p, 2, seed=3)]
    assert next_epoch != ids  # a new permutation


def test_labels_follow_pred_mask_positions():
    e1 = Example("a", [7, 8, 9, 10, 11], [0, 0, 1, 1, 1])
    e2 = Example("b", [7, 8, 12], [0, 1, 1])
    batch = collate([e1, e2], pad_id=0, max_len=16)
    assert batch.labels.tolist() == [9, 10, 11, 8, 12]
    pred = batch.pred_mask
    # logits at position t predict token t + 1: the next token of each pred position is a label
    nxt = batch.input_ids[:, 1:][pred[:, :-1]]
    assert nxt.tolist() == batch.labels.tolist()
    assert batch.loss_tokens == 5


def test_truncation_keeps_the_top_k_rows_of_the_remaining_labels():
    e = Example("a", [1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 1],
                topk_ids=[[1], [2], [3], [4]], topk_logprobs=[[-0.1], [-0.2], [-0.3], [-0.4]])
    cut = truncate(e, 5)
    assert cut.input_ids == [1, 2, 3, 4, 5] and cut.topk_ids == [[1], [2], [3]]
    batch = collate([e], pad_id=0, max_len=5)
    assert batch.topk_ids.shape[0] == batch.loss_tokens == 3


def test_on_policy_coins_are_stable_and_near_the_fraction():
    coins = [is_on_policy(p, 0.3, seed=1) for p in range(2000)]
    assert coins == [is_on_policy(p, 0.3, seed=1) for p in range(2000)]
    assert 0.25 < sum(coins) / len(coins) < 0.35
    assert not any(is_on_policy(p, 0.0, 1) for p in range(10))


def test_prompt_is_everything_before_the_first_target_token():
    assert prompt_of(Example("a", [5, 6, 7, 8], [0, 0, 1, 1])) == [5, 6]
    assert torch.equal(torch.tensor(prompt_of(Example("b", [5, 6], [0, 0]))), torch.tensor([5, 6]))
