"""Hub publishing without network: the dry run, the token rule, and what an upload would carry."""

import json
from pathlib import Path
from types import SimpleNamespace

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
    import huggingface_hub

    cfg, _ = exported
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no saved login either
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

        def repo_info(self, repo_id):
            return SimpleNamespace(private=seen["repo"][1])

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
    published = seen["files"]["config.yaml"].decode()  # the resolved config, as published
    assert str(cfg.run.output_path) not in published and str(tmp_path) not in published
    assert "hf_secret_value" not in "".join(
        p.read_text(errors="ignore") for p in result.folder.iterdir() if p.is_file())


class FakeHub:
    """The Hub's API for one existing or new repo: records the calls, uploads nothing."""

    def __init__(self, public_repos=()):
        self.public, self.calls = set(public_repos), []

    def __call__(self, token):
        self.calls.append(("token", token))
        return self

    def create_repo(self, repo_id, private, exist_ok):
        self.calls.append(("create_repo", repo_id, private))

    def repo_info(self, repo_id):
        return SimpleNamespace(private=repo_id not in self.public)

    def create_branch(self, repo_id, branch, exist_ok):
        self.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, folder_path, repo_id, commit_message, revision=None):
        self.calls.append(("upload_folder", repo_id, revision))


def test_a_public_repo_asked_for_as_private_is_refused_and_nothing_is_uploaded(exported,
                                                                               monkeypatch):
    import huggingface_hub

    cfg, _ = exported
    hub = FakeHub(public_repos={"someone/public-drafts"})
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    with pytest.raises(ConfigError, match="is public.*nothing was uploaded"):
        publish(cfg, "someone/public-drafts", private=True)
    assert not [c for c in hub.calls if c[0] == "upload_folder"]
    publish(cfg, "someone/public-drafts", private=False)  # asked public: fine
    assert hub.calls[-1] == ("upload_folder", "someone/public-drafts", None)


def test_the_publish_stage_uses_the_recipe_section_and_the_saved_login(exported, monkeypatch):
    import huggingface_hub

    from serving.publish import publish_stage

    cfg, _ = exported
    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", hub)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_from_login")
    staged = load_config(None, [f"model.target={cfg.model.target}",
                                f"run.output_dir={cfg.run.output_path}",
                                "publish.repo_id=someone/tiny", "publish.revision=v1"])
    publish_stage(staged)
    assert ("token", "hf_from_login") in hub.calls
    assert ("create_repo", "someone/tiny", True) in hub.calls  # private unless said otherwise
    assert hub.calls[-2:] == [("create_branch", "someone/tiny", "v1"),
                              ("upload_folder", "someone/tiny", "v1")]
    with pytest.raises(ConfigError, match="publish.repo_id"):
        publish_stage(cfg)
    with pytest.raises(ConfigError, match="must be '<user or org>/<name>'"):
        load_config(None, ["publish.repo_id=no-namespace"])


def test_the_published_config_holds_no_local_path_and_no_private_endpoint(tmp_path):
    from serving.publish import public_config

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("")
    resolved = {"run": {"name": "r", "output_dir": str(tmp_path / "runs")},
                "model": {"target": str(tmp_path / "my-target")},
                "data": {"sources": ["sharegpt", str(prompts)]},
                "generation": {"openai_endpoints": ["http://10.0.0.5:8000/v1"],
                               "openai_api_key_env": "OPENAI_API_KEY"},
                "train": {"draft": "eagle3"}, "eval": {"prompts": str(prompts)}}
    public = public_config(resolved, str(tmp_path / "my-target"), "org/target")
    text = json.dumps(public)
    assert str(tmp_path) not in text and "10.0.0.5" not in text
    assert public["model"]["target"] == "org/target" and public["run"]["output_dir"] is None
    assert public["data"]["sources"] == ["sharegpt", "<a local file: prompts.jsonl>"]
    assert public["generation"]["openai_api_key_env"] == "OPENAI_API_KEY"  # a name, kept
    assert public["train"]["draft"] == "eagle3" and resolved["run"]["output_dir"]  # a copy
