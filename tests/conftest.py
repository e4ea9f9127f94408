"""Shared fixtures: the embedded target's tokenizer, a tiny random 2-layer target using it, and
stage-1 data from that target written once per session and copied into each test that trains."""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from recipe import load_config
from tests.helpers import (
    VLLM_STAGE1,
    chat_records,
    recipe_path,
    reset_accelerate,
    save_tiny_llama,
    tiny_overrides,
    write_jsonl,
)


def pytest_addoption(parser) -> None:
    parser.addoption("--device", default="cpu",
                     help="the device of the device tier (tests/gpu, marker gpu): cpu, cuda, "
                          "cuda:1, ... (default cpu)")


@pytest.fixture(scope="session")
def device(request):
    """The device tier's torch device (--device)."""
    import torch

    chosen = torch.device(request.config.getoption("--device"))
    if chosen.type == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"--device {chosen}: torch {torch.__version__} sees no CUDA device here; "
                    "run the device tier with --device cpu or on a GPU machine.", returncode=2)
    return chosen


FAST_TIER_LIMIT_S = 20.0
"""A fast-tier test whose call or setup takes longer is listed at the end of the run."""
_fast_tier_over: list[tuple[str, str, float]] = []


def pytest_runtest_logreport(report) -> None:
    if report.when in ("setup", "call") and report.duration > FAST_TIER_LIMIT_S and not (
            {"slow", "integration"} & set(report.keywords)):
        _fast_tier_over.append((report.nodeid, report.when, report.duration))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _fast_tier_over:
        return
    terminalreporter.section(f"fast-tier tests over {FAST_TIER_LIMIT_S:.0f} s "
                             "(mark them slow, or share their setup)")
    for nodeid, when, seconds in sorted(_fast_tier_over, key=lambda x: -x[2]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {when:5s}  {nodeid}")


def llamacpp_for_tests() -> Path:
    """llama.cpp's build (~5 min on 2 cores) is a tool, not user data: built once per machine
    for the tests, in a folder of their own (serving/engines/llamacpp_build.py;
    $DRAFTSMITH_LLAMACPP wins)."""
    if "DRAFTSMITH_LLAMACPP" not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        os.environ["DRAFTSMITH_LLAMACPP"] = str(Path(base) / "draftsmith-tests" / "llamacpp")
    return Path(os.environ["DRAFTSMITH_LLAMACPP"])


def torch_extensions_for_tests() -> Path:
    """DeepSpeed's shared-memory collective op, which torch compiles on DeepSpeed's first CPU
    launch, is built for the tests in a folder of their own beside llama.cpp's. torch's build
    lock is a plain file: a build killed midway leaves it behind, and every later DeepSpeed
    launch then waits on it forever. Every test session holds a shared flock on the folder
    (released when its process ends, however it ends); a session that can take it exclusively
    knows no other pytest run uses the folder, so no build can be under way, and removes
    leftover locks."""
    global _sessions_lock
    folder = llamacpp_for_tests().parent / "torch_extensions"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    if _sessions_lock is None:
        folder.mkdir(parents=True, exist_ok=True)
        _sessions_lock = (folder / ".sessions").open("w")
        try:
            fcntl.flock(_sessions_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for stale in folder.glob("*/lock"):
                print(f"removing {stale}: left by a build that was stopped", file=sys.stderr)
                stale.unlink()
        except BlockingIOError:
            pass                                # another test session: its builds may run
        fcntl.flock(_sessions_lock, fcntl.LOCK_SH)
    return folder


_sessions_lock = None
_background_builds: list[tuple[subprocess.Popen, bool]] = []
"""(process, whether stopping it early is safe)."""


def _needs_llamacpp(item) -> bool:
    return "llamacpp" in getattr(item, "fixturenames", ())


def _builds_wanted(items) -> list[tuple[list[str], bool]]:
    """The tools that the selected slow tests need and that are not built yet, as (command,
    whether stopping it early is safe): llama.cpp's llama-server (the `llamacpp` fixture; an
    unfinished build carries no stamp and is started afresh) and DeepSpeed's shared-memory
    collective op, compiled on DeepSpeed's first CPU launch (~40 s; the tests whose accelerate
    config is a deepspeed-*.yaml; torch's extension lock would outlive a stopped build)."""
    from serving.engines.llamacpp_build import BUILD, missing_build_tools

    launched = [item for item in items
                if item.get_closest_marker("slow") or item.get_closest_marker("integration")]
    builds = []
    stamp = llamacpp_for_tests() / BUILD / "build" / "draftsmith-build.json"
    if (any(_needs_llamacpp(item) for item in launched)
            and not stamp.is_file() and not missing_build_tools()):
        builds.append(([sys.executable, "-c",
                        "from serving.engines.llamacpp_build import main; main()"], True))
    if any("deepspeed" in item.nodeid for item in launched) and find_spec("deepspeed"):
        builds.append(([sys.executable, "-c",
                        "from deepspeed.comm.torch import build_shm_op; build_shm_op()"], False))
    return builds


def pytest_collection_modifyitems(session, config, items) -> None:
    """The modules of tests that need llama.cpp's build run last, in their own order: the
    background build (pytest_collection_finish: ~5 minutes of both cores alone; its last build
    here, at nice 19 beside the slow tier, took 29 minutes) has the whole run before them to
    finish in, instead of making the first of them wait for what is left of it."""
    late = {getattr(item, "module", None) for item in items if _needs_llamacpp(item)}
    items[:] = ([item for item in items if getattr(item, "module", None) not in late]
                + [item for item in items if getattr(item, "module", None) in late])


def pytest_collection_finish(session) -> None:
    """Builds the selected tests will need start at once in the background at the lowest
    priority: they take the CPU time the tests before them leave idle (one-thread vLLM
    engines, imports), and the tests that need them wait on each build's own lock (llama.cpp's,
    torch's extension lock) for whatever is left. Each build stays in pytest's session: with
    Linux's autogroup scheduling a new session would take its own equal share of the CPU, nice
    or not."""
    if session.config.option.collectonly:
        return                                  # listing tests builds nothing
    torch_extensions_for_tests()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for i, (command, stoppable) in enumerate(_builds_wanted(session.items)):
        log = llamacpp_for_tests() / f"background-build-{i}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            process = subprocess.Popen(["nice", "-n", "19", *command], stdout=out,
                                       stderr=subprocess.STDOUT, process_group=0,
                                       cwd=Path(__file__).parents[1])
        _background_builds.append((process, stoppable))
        if reporter:
            reporter.write_line(f"building in the background (nice 19): {shlex.join(command)}; "
                                f"log {log}")


def pytest_sessionfinish(session) -> None:
    """Background builds still running when the tests end (they stopped early): llama.cpp's is
    stopped, DeepSpeed's (seconds) waited for."""
    for process, stoppable in _background_builds:
        if stoppable and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait()


TEST_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1"}
QWEN_CODER = "embedded:Qwen2.5-Coder-0.5B-Instruct"
"""Set, with DRAFTSMITH_CACHE, for the whole test run and every process it starts. vLLM-CPU
allocates and touches its whole KV cache as an engine starts: with 1 GiB instead of the 4 GiB
vllm_cpu_environment gives a user's run, the embedded target's engine starts in 4.0 s instead
of 7.6 s, and the tests' longest sequences need about 0.4 GiB."""


@pytest.fixture(scope="session", autouse=True)
def temporary_cache(tmp_path_factory) -> Path:
    """Every test (and every process a test starts) writes under a temporary cache, never the
    user's ~/.cache/draftsmith: the converted target, runs, vLLM's and inductor's compile
    caches."""
    cache = tmp_path_factory.mktemp("draftsmith-cache")
    environment = {**TEST_ENVIRONMENT, "DRAFTSMITH_CACHE": str(cache),
                   "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}  # compiled draft steps
    before = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    llamacpp_for_tests()
    yield cache
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder (converted once into the cache)."""
    from assets.target import convert_embedded

    return convert_embedded()


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """The embedded target's tokenizer and chat template, read from its GGUF and saved as
    convert_embedded saves them, without converting the weights (the fast tier never needs
    them)."""
    from transformers import AutoTokenizer

    from assets.target import embedded_tokenizer

    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    embedded_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def qwen_coder_tokenizer(tmp_path_factory):
    """The second embedded target's tokenizer and chat template (Qwen2.5-Coder-0.5B-Instruct),
    read from the header cut out of its first package alone, as convert_embedded saves them."""
    from transformers import AutoTokenizer

    from assets.target import embedded_tokenizer

    folder = tmp_path_factory.mktemp("qwen_coder_tokenizer")
    embedded_tokenizer(QWEN_CODER).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session", params=["smollm2", "qwen_coder"])
def chat_tokenizer(request):
    """Each embedded target's tokenizer in turn."""
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer, 64-dim Llama with SmolLM2's tokenizer and chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_target"), smollm2_tokenizer,
                           context=512, init=0.02, bos_token_id=1, eos_token_id=2,
                           pad_token_id=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_stage1(tiny_target, tmp_path_factory) -> tuple[Path, Path]:
    """(prompts file, a run folder holding complete stage-1 data of 16 conversations)."""
    from accelerate import Accelerator

    from distill import run_distill

    root = tmp_path_factory.mktemp("tiny_stage1")
    prompts = write_jsonl(root / "prompts.jsonl", chat_records(16))
    out = root / "run"
    run_distill(load_config(recipe_path("smollm2-135m-independent"),
                            tiny_overrides(tiny_target, prompts, out)), Accelerator(cpu=True))
    reset_accelerate()
    return prompts, out


@pytest.fixture(scope="session")
def vllm_stage1(tmp_path_factory) -> Path:
    """A run folder holding stage 1 of VLLM_STAGE1 written by the vLLM backend (real target,
    real vLLM), once per session: the rows the transformers backend and vLLM's OpenAI server
    must write."""
    import vllm  # noqa: F401  (installed by the README's setup: a missing vLLM fails, never skips)
    from accelerate import Accelerator

    from distill import run_distill

    out = tmp_path_factory.mktemp("vllm_stage1") / "run"
    run_distill(load_config(recipe_path("smollm2-135m-independent"),
                            [f"run.output_dir={out}", "generation.backend=vllm", *VLLM_STAGE1]),
                Accelerator(cpu=True))
    reset_accelerate()
    return out


@pytest.fixture
def tiny_run(tiny_target, tiny_stage1, tmp_path):
    """-> function(*overrides) giving a Config whose run folder holds a copy of the data."""
    prompts, source = tiny_stage1
    out = tmp_path / "run"
    shutil.copytree(source, out)

    def make(*overrides: str):
        return load_config(recipe_path("smollm2-135m-independent"),
                           tiny_overrides(tiny_target, prompts, out) + list(overrides))
    return make


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator; accelerate keeps process-wide singletons."""
    yield
    reset_accelerate()


@pytest.fixture(scope="session")
def llamacpp():
    """llama.cpp's llama-server, built once per machine into $DRAFTSMITH_LLAMACPP (~5 minutes
    on 2 cores the first time, less what the background build did: pytest_collection_finish):
    setup that the llama.cpp tests share, timed as such."""
    from serving.engines.llamacpp_build import ensure_llamacpp

    return ensure_llamacpp()
