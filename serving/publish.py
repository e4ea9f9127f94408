"""Publish an exported draft folder to the Hugging Face Hub.

    .venv/bin/python -m serving.publish --config configs/smollm2-135m-medusa.yaml \
        --repo-id you/smollm2-135m-medusa [--private] [--dry-run]

Uploads <run>/export/<kind>/ (or --folder), as written by `serving.export`. Local paths in the
model card and in vllm_speculative_config.json become hub ids (the draft's repo id, and the
target's hub id when it has one), so the serving command works for whoever downloads it. The
token is read from HF_TOKEN only and is never written anywhere; --dry-run prints what would be
uploaded and touches no network.
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


def _staged(folder: Path, repo_id: str, local_target: str | None, target_id: str | None,
            into: Path) -> Path:
    """A copy of the folder whose serving command names hub ids instead of local paths."""
    staged = into / folder.name
    shutil.copytree(folder, staged)
    for name in ("README.md", "vllm_speculative_config.json"):
        path = staged / name
        if path.is_file():
            text = path.read_text().replace(str(folder.resolve()), repo_id)
            if local_target and target_id:
                text = text.replace(local_target, target_id)
            path.write_text(text)
    return staged


def publish(cfg: Config, repo_id: str, folder: Path | None = None, private: bool = False,
            dry_run: bool = False) -> Upload:
    if "/" not in repo_id or repo_id.count("/") > 1:
        raise ConfigError(f"--repo-id {repo_id!r} must be '<user or org>/<name>'.")
    folder = single_export(cfg, folder, CONFIG_NAME, "serving.export")
    token = os.environ.get(TOKEN_VARIABLE)
    if not dry_run and not token:
        raise ConfigError(f"no Hub token: set {TOKEN_VARIABLE} in the environment (a write token "
                          "from https://huggingface.co/settings/tokens), or use --dry-run.")
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
        commit = api.upload_folder(folder_path=str(staged), repo_id=repo_id,
                                   commit_message="draftsmith: upload draft")
        return Upload(repo_id, files, dry_run=False, url=getattr(commit, "commit_url", None))


def main(argv: list[str] | None = None) -> None:
    from recipe import load_config

    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--folder", type=Path, help="export folder (default <run>/export/*)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    try:
        upload = publish(cfg, args.repo_id, args.folder, args.private, args.dry_run)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    verb = "would upload" if upload.dry_run else "uploaded"
    print(f"[publish] {verb} {len(upload.files)} files to {upload.repo_id}"
          f"{' (private)' if args.private else ''}:")
    for name, size in upload.files:
        print(f"  {name}  {size:,} bytes")
    if upload.url:
        print(f"[publish] {upload.url}")
    print(json.dumps({"repo_id": upload.repo_id, "dry_run": upload.dry_run}))


if __name__ == "__main__":
    main()
