"""Hub publishing without network: the dry run, the token rule, and what an upload would carry."""

import json
from pathlib import Path

import pytest

from recipe import ConfigError, load_config
from serving.export import export_draft
from serving.publish import publish
from tests.serving.test_export import _heads


@pytest.fixture
def exported(tiny_target, tmp_path):
    _heads(tiny_target, tmp_path / "run" / "train" / "draft", num_heads=2)
    cfg = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path / 'run'}"])
    return cfg, export_draft(cfg, k=2)


def test_dry_run_lists_the_files_and_needs_no_token(exported, monkeypatch):
    cfg, _ = exported
    monkeypatch.delenv("HF_TOKEN", raising=False)
    upload = publish(cfg, "someone/tiny-medusa", dry_run=True)
    names = [name for name, _ in upload.files]
    assert {"config.json", "model.safetensors", "README.md", "config.yaml",
            "vllm_speculative_config.json"} <= set(names)
    assert upload.dry_run and upload.url is None


def test_a_real_push_without_a_token_is_refused(exported, monkeypatch):
    cfg, _ = exported
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="set HF_TOKEN"):
        publish(cfg, "someone/tiny-medusa")
    with pytest.raises(ConfigError, match="must be '<user or org>/<name>'"):
        publish(cfg, "no-namespace", dry_run=True)


def test_the_upload_names_hub_ids_and_never_writes_the_token(exported, monkeypatch, tmp_path):
    import huggingface_hub

    cfg, result = exported
    seen = {}

    class RecordingApi:  # stands in for the Hub; records what would be sent
        def __init__(self, token):
            seen["token"] = token

        def create_repo(self, repo_id, private, exist_ok):
            seen["repo"] = (repo_id, private)

        def upload_folder(self, folder_path, repo_id, commit_message):
            seen["files"] = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    publish(cfg, "someone/tiny-medusa", private=True)
    assert seen["repo"] == ("someone/tiny-medusa", True) and seen["token"] == "hf_secret_value"
    speculative = json.loads(seen["files"]["vllm_speculative_config.json"])
    assert speculative["model"] == "someone/tiny-medusa" and speculative["method"] == "medusa"
    assert str(result.folder.resolve()) not in seen["files"]["README.md"].decode()
    assert all(b"hf_secret_value" not in content for content in seen["files"].values())
    assert "hf_secret_value" not in "".join(
        p.read_text(errors="ignore") for p in result.folder.iterdir() if p.is_file())
