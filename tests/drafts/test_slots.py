"""drafts.slots.SlotKV: the drafts' preallocated caches hold what concatenation would."""

import torch

from drafts.slots import SlotKV


def test_appends_crops_and_growth_keep_what_concatenation_would():
    torch.manual_seed(0)
    cache = SlotKV(2, 2, 3, 4, torch.float32, "cpu", capacity=4)
    keys = [torch.zeros(2, 3, 0, 4) for _ in range(2)]
    values = [torch.zeros(2, 3, 0, 4) for _ in range(2)]
    mask = torch.zeros(2, 0, dtype=torch.bool)
    for t, crop in [(3, 0), (2, 1), (5, 2), (1, 0), (7, 3)]:  # grows past 4, 8 and 16 slots
        kv = [(torch.randn(2, 3, t, 4), torch.randn(2, 3, t, 4)) for _ in range(2)]
        valid = torch.rand(2, t) > 0.3
        cache.append(kv, valid)
        end = mask.shape[1] + t - crop
        for layer, (k, v) in enumerate(kv):
            keys[layer] = torch.cat([keys[layer], k], 2)[:, :, :end]
            values[layer] = torch.cat([values[layer], v], 2)[:, :, :end]
        mask = torch.cat([mask, valid], 1)[:, :end]
        cache.crop(crop)
        for layer in range(2):
            assert torch.equal(cache.keys(layer), keys[layer])
            assert torch.equal(cache.values(layer), values[layer])
        assert torch.equal(cache.mask, mask)
    assert cache.capacity >= cache.length == mask.shape[1]


def test_a_rows_copy_is_independent_of_the_batch():
    cache = SlotKV(3, 1, 1, 2, torch.float32, "cpu", capacity=2)
    cache.append([(torch.arange(18.).view(3, 1, 3, 2), torch.ones(3, 1, 3, 2))],
                 torch.ones(3, 3, dtype=torch.bool))
    row = cache.rows(slice(1, 2))
    assert torch.equal(row.keys(), cache.keys()[1:2]) and row.length == 3
    row.append([(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))],
               torch.zeros(1, 1, dtype=torch.bool))
    assert cache.length == 3 and row.length == 4
    assert torch.equal(cache.keys()[1, 0, 0], torch.tensor([6., 7.]))
