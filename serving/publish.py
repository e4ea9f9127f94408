"""Publish an exported draft folder to the Hugging Face Hub.

    .venv/bin/python -m serving.publish --config configs/smollm2-135m-medusa.yaml \
        --repo-id you/smollm2-135m-medusa [--private] [--revision BRANCH] [--dry-run]

Uploads <run>/export/<kind>/ (or --folder), as written by `serving.export`; the repo, privacy
and branch default to the recipe's publish section (publish.private=false to publish public),
which also makes publishing the pipeline's last stage (distill.py). Local paths in the model
card and in vllm_speculative_config.json become hub ids (the draft's repo id, and the target's
hub id when it has one), so the serving command works for whoever downloads it. The token is the
Hub's usual one (HF_TOKEN, else the one `hf auth login` saved) and is never written anywhere;
--dry-run prints what would be uploaded and touches no network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from assets.target import resolve_target
from recipe import Config, ConfigError
from serving.card import target_hub_id
from serving.engines.base import single_export
from serving.engines.vllm import CONFIG_NAME

TOKEN_VARIABLE = "HF_TOKEN"


@dataclass
class Upload:
    repo_id: str
    files: list[tuple[str, int]]
    """(path in the repo, bytes) of every file uploaded."""
    dry_run: bool
    url: str | None = None


def public_config(resolved: dict, local_target: str | None, target_id: str | None) -> dict:
    """A resolved config as published: what a reader needs to repeat the run, without this
    machine's paths or a private server's address. The run folder, local source and prompt
    files keep their file names alone; the target's local folder becomes its hub id (or a note);
    the stage-1 endpoints are dropped (the environment variable that held the key is a name)."""
    out = {section: dict(values) for section, values in resolved.items()}

    def local(value) -> bool:
        return isinstance(value, str) and (value.startswith(("/", "~", "./", "../"))
                                           or Path(value).expanduser().exists())

    run, model, data = out.get("run", {}), out.get("model", {}), out.get("data", {})
    if run.get("output_dir") is not None:
        run["output_dir"] = None
    if local(model.get("target")):
        model["target"] = target_id or (
            f"<a local folder: {Path(model['target']).name}>" if model["target"] != local_target
            else f"<a local folder: {Path(local_target).name}>")
    data["sources"] = [f"<a local file: {Path(s).name}>" if local(s) else s
                       for s in data.get("sources", [])]
    generation = out.get("generation", {})
    if generation.get("openai_endpoints"):
        generation["openai_endpoints"] = [f"<{len(generation['openai_endpoints'])} endpoint(s), "
                                          "not published>"]
    ev = out.get("eval", {})
    for key in ("prompts", "draft"):
        if local(ev.get(key)):
            ev[key] = f"<a local path: {Path(ev[key]).name}>"
    if local(out.get("train", {}).get("draft")):
        out["train"]["draft"] = f"<a local folder: {Path(out['train']['draft']).name}>"
    return out


def _staged(folder: Path, repo_id: str, local_target: str | None, target_id: str | None,
            into: Path) -> Path:
    """A copy of the folder whose serving command names hub ids instead of local paths, and
    whose resolved configs hold neither this machine's paths nor private endpoints."""
    import yaml

    staged = into / folder.name
    shutil.copytree(folder, staged)
    for name in ("README.md", "vllm_speculative_config.json"):
        path = staged / name
        if path.is_file():
            text = path.read_text().replace(str(folder.resolve()), repo_id)
            if local_target and target_id:
                text = text.replace(local_target, target_id)
            path.write_text(text)
    for path in staged.rglob("config.yaml"):
        resolved = yaml.safe_load(path.read_text())
        if isinstance(resolved, dict) and "run" in resolved:  # a draftsmith resolved config
            path.write_text(yaml.safe_dump(public_config(resolved, local_target, target_id),
                                           sort_keys=False))
    return staged


def hub_token() -> str | None:
    """The Hub's credentials as its own tools find them: HF_TOKEN, else the token `hf auth
    login` saved."""
    from huggingface_hub import get_token

    return os.environ.get(TOKEN_VARIABLE) or get_token()


def publish(cfg: Config, repo_id: str, folder: Path | None = None, private: bool = False,
            dry_run: bool = False, revision: str | None = None) -> Upload:
    if "/" not in repo_id or repo_id.count("/") > 1:
        raise ConfigError(f"--repo-id {repo_id!r} must be '<user or org>/<name>'.")
    folder = single_export(cfg, folder, CONFIG_NAME, "serving.export")
    token = None if dry_run else hub_token()
    if not dry_run and not token:
        raise ConfigError(f"no Hub token: set {TOKEN_VARIABLE} in the environment or run `hf "
                          "auth login` (a write token from "
                          "https://huggingface.co/settings/tokens), or use --dry-run.")
    with tempfile.TemporaryDirectory() as tmp:
        staged = _staged(folder, repo_id, resolve_target(cfg.model).path, target_hub_id(cfg),
                         Path(tmp))
        files = sorted((str(p.relative_to(staged)), p.stat().st_size)
                       for p in staged.rglob("*") if p.is_file())
        if dry_run:
            return Upload(repo_id, files, dry_run=True)
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise ConfigError(f"{repo_id} exists on the Hub and is public, and the upload was "
                              "asked to be private: nothing was uploaded. Make the repo private "
                              "on the Hub (its Settings), choose another repo id, or publish it "
                              "public (publish.private=false / without --private).")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(folder_path=str(staged), repo_id=repo_id,
                                   commit_message="draftsmith: upload draft",
                                   **({"revision": revision} if revision else {}))
        return Upload(repo_id, files, dry_run=False, url=getattr(commit, "commit_url", None))


def publish_stage(cfg: Config) -> Upload:
    """The pipeline's publish stage: the export to publish.repo_id."""
    p = cfg.publish
    if p.repo_id is None:
        raise ConfigError("the publish stage needs publish.repo_id ('<user or org>/<name>').")
    upload = publish(cfg, p.repo_id, private=p.private, revision=p.revision)
    print(f"[publish] uploaded {len(upload.files)} files to {upload.repo_id}"
          f"{'@' + p.revision if p.revision else ''}"
          f" ({'private' if p.private else 'public'}){': ' + upload.url if upload.url else ''}")
    return upload


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--repo-id", default=None, help="default: the recipe's publish.repo_id")
    parser.add_argument("--folder", type=Path, help="export folder (default <run>/export/*)")
    parser.add_argument("--private", action="store_true", default=None,
                        help="default: the recipe's publish.private")
    parser.add_argument("--revision", default=None, help="default: the recipe's publish.revision")
    parser.add_argument("--dry-run", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    repo_id = args.repo_id or cfg.publish.repo_id
    private = cfg.publish.private if args.private is None else args.private
    if repo_id is None:
        raise SystemExit("error: no repo to publish to: pass --repo-id or set publish.repo_id.")
    try:
        upload = publish(cfg, repo_id, args.folder, private, args.dry_run,
                         args.revision or cfg.publish.revision)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    verb = "would upload" if upload.dry_run else "uploaded"
    print(f"[publish] {verb} {len(upload.files)} files to {upload.repo_id}"
          f" ({'private' if private else 'public'}):")
    for name, size in upload.files:
        print(f"  {name}  {size:,} bytes")
    if upload.url:
        print(f"[publish] {upload.url}")
    print(json.dumps({"repo_id": upload.repo_id, "dry_run": upload.dry_run}))


if __name__ == "__main__":
    main()
