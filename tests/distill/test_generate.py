"""Fast tier: which backend and batch size stage 1 runs, and the manifest's count of backends."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distill import generate
from recipe import GenerationConfig
from runfolder.shards import ShardWriter, backend_counts


@pytest.mark.parametrize(("installed", "backend", "batch_size"), [(True, "vllm", 64),
                                                                  (False, "hf", 16)])
def test_auto_backend_is_vllm_where_installed(monkeypatch, installed, backend, batch_size):
    real = generate.importlib.util.find_spec
    monkeypatch.setattr(generate.importlib.util, "find_spec",
                        lambda name: (object() if installed else None) if name == "vllm"
                        else real(name))
    gen = generate.resolve_generation(GenerationConfig())
    assert (gen.backend, gen.batch_size) == (backend, batch_size)


def test_explicit_backend_and_batch_size_are_kept():
    gen = generate.resolve_generation(GenerationConfig(backend="hf", batch_size=3))
    assert (gen.backend, gen.batch_size) == ("hf", 3)
    assert generate.resolve_generation(GenerationConfig(backend="vllm")).batch_size == 64


def _row(i: int, backend: str) -> dict:
    return {"id": f"c{i}", "source": "s", "split": "train", "messages": "[]", "input_ids": [1, 2],
            "loss_mask": [0, 1], "num_turns": 1, "generated_tokens": 1, "retokenized_replies": 0,
            "finish_reasons": ["stop"], "backend": backend}


def test_backend_counts_show_a_mixed_data_set_and_older_shards(tmp_path):
    writer = ShardWriter(tmp_path, rank=0, shard_size=2, top_k=0)
    for i, backend in enumerate(["hf", "hf", "vllm"]):
        writer.add(_row(i, backend))
    writer.end_batch()
    writer.close()
    assert backend_counts(tmp_path) == {"hf": 2, "vllm": 1}
    # a shard written before rows recorded their backend
    old = pa.Table.from_pylist([_row(7, "x")]).drop_columns(["backend"])
    pq.write_table(old, tmp_path / "train-r1-00000.parquet")
    assert backend_counts(tmp_path) == {"hf": 2, "unrecorded": 1, "vllm": 1}
