"""Integration tier: stage 1 with the vLLM backend writes the same files and manifest as with
transformers (real SmolLM2 target, fp32 greedy, real vLLM)."""

import pytest

from recipe import load_config
from tests.helpers import recipe_path

pytestmark = pytest.mark.integration


def test_vllm_backend_writes_what_the_hf_backend_writes(tmp_path):
    import pyarrow.parquet as pq
    import vllm  # noqa: F401  (installed by install.sh: a missing vLLM fails, never skips)
    from accelerate import Accelerator

    from distill import run_distill
    from runfolder import read_manifest, shard_files

    def run(backend):
        cfg = load_config(recipe_path("smollm2-135m-independent"), [
            f"run.output_dir={tmp_path / backend}", "data.max_prompts=6",
            "generation.max_new_tokens=32", "generation.batch_size=3",
            f"generation.backend={backend}", "generation.vllm_enforce_eager=true"])
        run_distill(cfg, Accelerator(cpu=True))
        rows = [r for path in shard_files(tmp_path / backend / "data")
                for r in pq.read_table(path).to_pylist()]
        manifest = read_manifest(tmp_path / backend)
        # each row and the manifest name who generated it; everything else must match
        assert {r.pop("backend") for r in rows} == {backend}
        assert manifest.pop("generated_by") == {backend: len(rows)}
        return sorted(rows, key=lambda r: r["id"]), manifest

    hf_rows, hf_manifest = run("hf")
    vllm_rows, vllm_manifest = run("vllm")
    assert len(hf_rows) >= 5 and hf_manifest == vllm_manifest
    assert sum(r["num_turns"] for r in hf_rows) > len(hf_rows)  # second turns were generated
    for a, b in zip(hf_rows, vllm_rows):
        assert a == b, a["id"]
