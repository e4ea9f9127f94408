import shutil
from dataclasses import replace

from recipe import DecodeSettings
from runfolder import run_folder
from serving import validate


def test_our_run_is_decoded_once_and_again_when_the_draft_changes(tiny_run, tiny_target,
                                                                   monkeypatch):
    cfg = tiny_run()
    draft = run_folder(cfg).draft
    shutil.copytree(tiny_target, draft)  # the target drafting for itself
    decoded = []
    real = validate.decode_prompts
    monkeypatch.setattr(validate, "decode_prompts",
                        lambda *a, **k: decoded.append(1) or real(*a, **k))
    settings = DecodeSettings(max_new_tokens=6, k=2)
    first = validate.our_run(cfg, settings)
    again = validate.our_run(cfg, settings)
    assert len(decoded) == 1 and again.tokens == first.tokens and again.stats == first.stats
    assert first.stats[0].steps > 0 and again.draft_name == first.draft_name
    validate.our_run(cfg, replace(settings, k=3))  # other settings: decoded
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # re-written weights (new mtime): decoded
    validate.our_run(cfg, settings)
    assert len(decoded) == 3
