"""benchmarks/weight_formats.py's draft check: how much of a draft's greedy choice and
distribution each quantised format keeps."""

import torch

from benchmarks.weight_formats import agreement
from tests.helpers import tiny_llama


def test_coarser_weights_keep_less_of_the_drafts_choices():
    model = tiny_llama(64, seed=0, layers=2)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(0))
    (kept8, kl8), (kept4, kl4) = agreement(model, ids, "int8"), agreement(model, ids, "int4")
    assert kept8 > 0.9 and 0 < kl8 < 0.01
    assert kept4 < kept8 and kl4 > kl8
