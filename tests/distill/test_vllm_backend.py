"""Integration tier: stage 1 with the vLLM backend writes the same files and manifest as with
transformers (real SmolLM2 target, fp32 greedy, real vLLM)."""

import pytest

from recipe import load_config
from tests.helpers import VLLM_STAGE1, recipe_path

pytestmark = pytest.mark.integration


def test_vllm_backend_writes_what_the_hf_backend_writes(vllm_stage1, tmp_path):
    import pyarrow.parquet as pq
    from accelerate import Accelerator

    from distill import run_distill
    from runfolder import read_manifest, shard_files

    def written(out, backend):
        rows = [r for path in shard_files(out / "data") for r in pq.read_table(path).to_pylist()]
        manifest = read_manifest(out)
        # each row and the manifest name who generated it; everything else must match
        assert {r.pop("backend") for r in rows} == {backend}
        assert manifest.pop("generated_by") == {backend: len(rows)}
        return sorted(rows, key=lambda r: r["id"]), manifest

    run_distill(load_config(recipe_path("smollm2-135m-independent"), [
        f"run.output_dir={tmp_path / 'hf'}", "generation.backend=hf", *VLLM_STAGE1]),
        Accelerator(cpu=True))
    hf_rows, hf_manifest = written(tmp_path / "hf", "hf")
    vllm_rows, vllm_manifest = written(vllm_stage1, "vllm")
    assert len(hf_rows) >= 7 and hf_manifest == vllm_manifest
    assert sum(r["num_turns"] for r in hf_rows) > len(hf_rows)  # second turns were generated
    for a, b in zip(hf_rows, vllm_rows, strict=True):
        assert a == b, a["id"]
