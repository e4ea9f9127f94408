"""llama.cpp's build, conversion checks and counters, without building it: a machine without
the tools is told what to install, a failed build leaves nothing behind, a GGUF draft with
another vocabulary is refused, llama-server's counters map to tau and alpha_k, and a run is
kept and reused until a GGUF changes."""

import json
import os
import stat

import pytest

from recipe import ConfigError
from serving.engines import llamacpp_build as llamacpp
from serving.engines.llamacpp import spec_counters

METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 210
llamacpp:spec_decode_num_draft_tokens_total 120
llamacpp:spec_decode_num_accepted_tokens_total 50
llamacpp:spec_decode_num_drafts_total 40
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 25
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 15
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 10
"""


def test_llama_servers_counters_are_read_as_drafts_accepted_and_per_position():
    counters = spec_counters(METRICS)
    assert counters == {"drafts": 40, "draft_tokens": 120, "accepted": 50,
                        "accepted_per_position": [25, 15, 10]}
    assert sum(counters["accepted_per_position"]) == counters["accepted"]  # as tau needs
    assert spec_counters("llamacpp:prompt_tokens_total 3\n")["drafts"] == 0


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP", str(tmp_path / "llamacpp"))
    return tmp_path / "llamacpp" / llamacpp.BUILD


def test_a_machine_without_cmake_is_told_what_to_install_and_nothing_is_made(root, monkeypatch):
    real = llamacpp.shutil.which
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None if name == "cmake"
                        else real(name))
    with pytest.raises(ConfigError, match=r"lacks cmake: install them .*Nothing was built"):
        llamacpp.ensure_llamacpp(log=lambda *a: None)
    assert not root.exists()


def test_a_failed_build_leaves_no_build_behind_and_says_where_the_log_is(root, tmp_path,
                                                                          monkeypatch):
    (root / "llama.cpp").mkdir(parents=True)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")  # sources already there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"  # configures (writes into the build folder), then fails
    cmake.write_text("#!/bin/sh\nmkdir -p \"$4\" && touch \"$4/CMakeCache.txt\"\n"
                     "echo 'error: no compiler works' >&2\nexit 3\n")
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(RuntimeError, match=r"(?s)building llama.cpp failed .*exit 3.*no compiler"
                                           r" works"):
        llamacpp.ensure_llamacpp(log=lambda *a: None)
    assert not (root / "build").exists() and (root / "build.log").is_file()


def test_a_unity_build_that_fails_is_built_again_file_by_file(root, tmp_path, monkeypatch):
    (root / "llama.cpp").mkdir(parents=True)
    (root / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"  # configure remembers unity; the build fails for a unity build
    cmake.write_text(
        "#!/bin/sh\n"
        "if [ \"$1\" = -S ]; then echo \"$*\" > \"$4/configured\"; exit 0; fi\n"
        "if grep -q UNITY_BUILD=ON \"$2/configured\"; then echo 'error: redefinition' >&2; "
        "exit 2; fi\n"
        "mkdir -p \"$2/bin\" && touch \"$2/bin/llama-server\"\n")
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    said = []
    built = llamacpp.ensure_llamacpp(log=said.append)
    assert built.server.is_file() and any("unity build failed" in line for line in said)
    stamp = json.loads((root / "build" / "draftsmith-build.json").read_text())
    assert stamp["unity_build"] is False
    log = (root / "build.log").read_text()
    assert "error: redefinition" in log and "UNITY_BUILD=ON" not in log.split("$ ")[-2]
    hooks = [line for line in log.splitlines() if "CMAKE_PROJECT_ggml_INCLUDE" in line]
    assert len(hooks) == 1  # the unity configure, with its exceptions; not the second
    # both builds compile the tools at -O1 and ggml's kernels at the build type's -O3
    assert log.count("CMAKE_PROJECT_llama.cpp_INCLUDE") == 2
    hook = (root / "build" / "llama.cpp-hook.cmake").read_text()
    assert "COMPILE_OPTIONS -O1" in hook and "SKIP_UNITY_BUILD_INCLUSION" not in hook
    assert "server-context" in hook and "ggml-cpu" not in hook
    assert stamp["at_o1"] == list(llamacpp.LIGHTLY_OPTIMISED)


def _gguf(path, tokens, model="gpt2"):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_draft_with_another_vocabulary_is_refused(tmp_path):
    target = _gguf(tmp_path / "target.gguf", ["<s>", "a", "b", "c"])
    llamacpp.check_same_vocabulary(target, _gguf(tmp_path / "same.gguf", ["<s>", "a", "b", "c"]))
    with pytest.raises(ConfigError, match=r"at token 2 \('x' vs the target's 'b'\)"):
        llamacpp.check_same_vocabulary(target, _gguf(tmp_path / "d.gguf", ["<s>", "a", "x", "c"]))
    with pytest.raises(ConfigError, match=r"\(gpt2, 3 tokens\) differs from the target's "
                                          r"\(gpt2, 4 tokens\)"):
        llamacpp.check_same_vocabulary(target, _gguf(tmp_path / "e.gguf", ["<s>", "a", "b"]))
    # an EAGLE-3 head's GGUF carries no vocabulary of its own: it borrows the target's
    llamacpp.check_same_vocabulary(target, _gguf(tmp_path / "head.gguf", [], model=""))


def test_a_llamacpp_run_is_kept_and_reused_until_a_gguf_changes(tmp_path, monkeypatch):
    """The second identical run (another check on our side of the same export) starts no
    llama-server; a re-written draft GGUF misses the cache."""
    from types import SimpleNamespace

    from recipe import DecodeSettings
    from serving.engines import llamacpp as engine
    from serving.engines.base import Exported

    started = []

    class FakeServer:
        def __init__(self, llama, target, draft, method, k, draft_sampling):
            started.append(draft)
            self.totals = {"drafts": 0, "draft_tokens": 0, "accepted_per_position": [0, 0]}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def counters(self):
            return {**self.totals,
                    "accepted_per_position": list(self.totals["accepted_per_position"])}

        def complete(self, prompt, max_tokens, temperature, seed):
            self.totals["drafts"] += 2
            self.totals["draft_tokens"] += 4
            self.totals["accepted_per_position"][0] += 1
            return [seed, len(prompt)]

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(engine, "LlamaServer", FakeServer)
    monkeypatch.setattr(engine, "ensure_llamacpp", lambda: SimpleNamespace(build_seconds=0.0))
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    target.write_bytes(b"target")
    draft.write_bytes(b"draft")
    exported = Exported(tmp_path, "draft-simple", 2, {"target": str(target), "draft": str(draft)})
    cfg = SimpleNamespace(run=SimpleNamespace(seed=7))
    settings = DecodeSettings(max_new_tokens=2, temperature=1.0)

    def run():
        return engine.LlamaCppEngine().run(cfg, exported, "unused", [[1, 2], [3]], settings,
                                           {2}, with_draft=True)

    first, second = run(), run()
    assert len(started) == 1 and not first.reused and second.reused
    assert second.tokens == first.tokens == [[7, 2], [8, 1]]
    assert second.per_prompt == first.per_prompt and second.counters == first.counters
    assert first.counters.drafts == 4
    draft.write_bytes(b"draft, converted again")
    assert not run().reused and len(started) == 2


def test_the_source_patch_records_qwen2_layer_inputs_and_refuses_another_tree(tmp_path):
    models = tmp_path / "src" / "models"
    models.mkdir(parents=True)
    loop = ("    for (int il = 0; il < n_layer; ++il) {\n        ggml_tensor * inpSA = inpL;\n"
            "        cur = build_norm(inpL);\n")
    (models / "qwen2.cpp").write_text("graph() {\n" + loop + "}\n")
    llamacpp.patch_source(tmp_path)
    patched = (models / "qwen2.cpp").read_text()
    assert "{\n        res->t_layer_inp[il] = inpL;\n\n        ggml_tensor * inpSA" in patched
    with pytest.raises(RuntimeError, match="not found once"):  # applied twice, or another version
        llamacpp.patch_source(tmp_path)


@pytest.mark.slow
@pytest.mark.usefixtures("llamacpp")
def test_the_built_tree_carries_the_source_patches(request):
    built = request.getfixturevalue("llamacpp")  # the session's build (the module is llamacpp)
    for name, (_, replacement) in llamacpp.SOURCE_PATCHES.items():
        assert replacement in (built.source / name).read_text(), name


def test_the_llamacpp_command_carries_the_chat_mode(tmp_path):
    from serving.engines.llamacpp import server_command

    command = server_command(tmp_path / "t.gguf", tmp_path / "d.gguf", "draft-eagle3", 3,
                             {"enable_thinking": False})
    assert command.endswith("""--chat-template-kwargs '{"enable_thinking": false}'""")
    assert "--chat-template-kwargs" not in server_command(tmp_path / "t.gguf",
                                                          tmp_path / "d.gguf", "draft-simple", 3, {})


def test_a_benchmark_arm_names_its_adaptive_verification_and_the_server_is_told_it(tmp_path):
    """draft-dspark:4@0.5: four drafted tokens a step, verified up to the first whose confidence
    is below 0.5 (llama-server's --spec-draft-p-min); without @, a fixed k (p-min 0)."""
    from types import SimpleNamespace

    from benchmarks.llamacpp_speed import Arm
    from serving.engines.llamacpp import LlamaServer

    adaptive, fixed = Arm.parse("draft-dspark:4@0.5"), Arm.parse("draft-eagle3+ngram-simple:3")
    assert (adaptive.spec_types, adaptive.k, adaptive.p_min) == (["draft-dspark"], 4, 0.5)
    assert (fixed.spec_types, fixed.k, fixed.p_min) == (["draft-eagle3", "ngram-simple"], 3, 0.0)
    for bad in ("draft-dspark:4@1.5", "draft-dspark:4@x", "draft-dspark:0"):
        with pytest.raises(ConfigError, match="write plain or"):
            Arm.parse(bad)
    llama = SimpleNamespace(server=tmp_path / "llama-server")
    for arm, p_min in ((adaptive, "0.5"), (fixed, "0.0")):
        command = LlamaServer(llama, tmp_path / "t.gguf", tmp_path / "d.gguf",
                              ",".join(arm.spec_types), arm.k, p_min=arm.p_min).command
        assert command[command.index("--spec-draft-p-min") + 1] == p_min
