"""llama.cpp as a serving engine: the draft kinds it serves and by which --spec-type, the GGUF
export (converted by llama.cpp's own converter, serving/engines/llamacpp_build.py), runs of
`llama-server` on 127.0.0.1 one request at a time with its Prometheus counters (`--metrics`,
counting speculation as vLLM's do: spec_counters), and the serving command.

At T > 0 llama.cpp's --spec-draft-sampling greedy (its default) proposes the draft's argmax and
accepts it when the target's own sample equals it: probability p(x), the replacement drawn from
p without x, which is our argmax drafting (draft_temperature 0). 'probabilistic' samples the
draft's top 10 at T and accepts with min(1, p/q), resampling from max(p - q, 0): our draft at T
with draft_top_k 10 (tools/server/server-context.cpp, common/sampling.cpp, common/speculative.cpp).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Self

from assets.target import resolve_target
from drafts import DraftKind
from recipe import Config, ConfigError, DecodeSettings, cache_root
from runfolder import run_folder
from serving.card import model_card, target_hub_id
from serving.engines.base import (
    Counters,
    EngineRun,
    Export,
    Exported,
    single_export,
    staged,
    summed,
    target_shape,
)
from serving.engines.llamacpp_build import (
    VERSION,
    LlamaCpp,
    check_same_vocabulary,
    convert_to_gguf,
    ensure_llamacpp,
)

SPEC_TYPES = {"independent": "draft-simple", "eagle3": "draft-eagle3", "dspark": "draft-dspark"}
UNREAD_EAGLE3_FIELDS = ("fc_norm", "norm_output")
"""EAGLE 3.1's config fields that llama.cpp's eagle3 graph and converter do not read."""
"""Draft kind -> llama.cpp's --spec-type."""

READS_TARGET = ("draft-eagle3", "draft-dspark")
"""Spec types whose conversion reads the target's folder (its vocabulary)."""

NOT_SERVED = {
    "dflash": f"llama.cpp {VERSION} has draft-dflash for Qwen lineages only",
    "pard": "llama.cpp would draft with a PARD model token by token, not in parallel",
    "prompt-lookup": "llama.cpp runs prompt lookup itself (--spec-type ngram-*): nothing to "
                     "export",
}

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
DRAFT_SAMPLINGS = ("greedy", "probabilistic")
DRAFT_TOP_K = 10
"""llama.cpp's probabilistic drafting samples the draft's 10 likeliest tokens at the request's
temperature (common/speculative.cpp, spec_retune: top_k 10, then temperature)."""

CONFIG_NAME = "llamacpp.json"


def target_gguf(cfg: Config, outtype: str = "f32", log=print) -> Path:
    """The target as GGUF, converted once by llama.cpp's converter into
    <cache>/gguf/<target>-<fingerprint>-<outtype>.gguf (a target is large: not copied into every
    export folder)."""
    target = resolve_target(cfg.model)
    if not Path(target.path).is_dir():
        raise ConfigError(f"the target {target.name!r} is not a local folder: llama.cpp's "
                          "converter reads one (download it, e.g. `hf download "
                          f"{target.name} --local-dir DIR`, and set model.target=DIR).")
    name = Path(target.name.removeprefix("embedded:")).name
    identity = hashlib.sha256(target.fingerprint.encode()).hexdigest()[:12]
    out = cache_root() / "gguf" / f"{name}-{identity}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"[export] converting the target to GGUF {outtype}: {out}")
        convert_to_gguf(Path(target.path), out, outtype, log=log)
    return out


def from_totals(steps: int, accepted_per_position: list[int], draft_tokens: int,
                k: int) -> Counters:
    """A request's counters from llama-server's totals: verification steps, accepted per
    position, draft tokens. llama-server does not say which positions a trimmed draft lacked;
    the D tokens a request drafted fewer than steps * k are counted as missing from positions
    k-D+1..k once each (exact for one trimmed step; every comparison counts both engines by this
    same rule, see budgeted)."""
    deficit = steps * k - draft_tokens
    return Counters(steps, list(accepted_per_position[:k]),
                    [steps - (1 if steps and j > k - deficit else 0) for j in range(1, k + 1)])


def per_request(after: dict, before: dict, k: int) -> Counters:
    """One request's counters: the difference of llama-server's totals around it."""
    width = len(after["accepted_per_position"])
    old = before["accepted_per_position"] + [0] * (width - len(before["accepted_per_position"]))
    return from_totals(after["drafts"] - before["drafts"],
                       [a - b for a, b in zip(after["accepted_per_position"], old)],
                       after["draft_tokens"] - before["draft_tokens"], k)


def budgeted(accepted_per_step: list[int], max_new_tokens: int, k: int) -> Counters:
    """One request of our engine as llama-server would have counted it. llama-server drafts
    at most n_remaining - 1 tokens (n_predict minus the tokens generated so far, the pending
    one included; tools/server/server-context.cpp, get_n_draft_max), and with 1 token left
    decodes it without a draft, a step it does not count; our engine (as vLLM) drafts k at every
    step and stops the row at max_new_tokens. On the same greedy trajectory a step where ours
    accepted a of k has llama.cpp accept min(a, D) of its D: the draft's first D proposals are
    the same, the text the same."""
    generated, steps, draft_tokens, accepted = 1, 0, 0, [0] * k  # prefill made the first token
    for a in accepted_per_step:
        left = max_new_tokens - generated
        if left <= 1:
            generated += 1
            continue
        drafted = min(k, left - 1)
        n = min(a, drafted)
        steps, draft_tokens = steps + 1, draft_tokens + drafted
        for j in range(n):
            accepted[j] += 1
        generated += n + 1
    return from_totals(steps, accepted, draft_tokens, k)


@dataclass
class LlamaCppEngine:
    """draft_sampling: llama.cpp's --spec-draft-sampling at T > 0 (greedy, its default: argmax
    drafting; probabilistic: the draft's top 10 sampled, rejection sampling). gguf_type: the
    GGUF weight type of draft and target an export writes (f32: what the comparison with our
    fp32 engine needs)."""

    draft_sampling: str = "greedy"
    gguf_type: str = "f32"
    name = "llamacpp"
    label = "llama.cpp"
    formats = ("gguf",)
    report_name = "results-llamacpp.json"

    def __post_init__(self) -> None:
        if self.draft_sampling not in DRAFT_SAMPLINGS:
            raise ConfigError(f"llama.cpp's draft sampling {self.draft_sampling!r} is not one it "
                              "knows: 'greedy' or 'probabilistic' (--spec-draft-sampling).")
        if self.gguf_type not in GGUF_TYPES:
            raise ConfigError(f"--gguf-type {self.gguf_type!r}: choose one of {list(GGUF_TYPES)}.")

    def why_not(self, kind: DraftKind) -> str | None:
        if kind.name in SPEC_TYPES:
            return None
        reason = NOT_SERVED.get(kind.name, f"llama.cpp {VERSION} does not serve "
                                           f"{kind.description}")
        return f"{reason} (it serves independent drafts, EAGLE-3 heads and DSpark drafters)."

    def export(self, cfg: Config, draft_folder: Path, kind: DraftKind, k: int, fmt: str = "gguf",
               out: Path | None = None, log=print) -> Export:
        """The draft as GGUF for llama.cpp (`llama-server -m target.gguf -md draft.gguf`),
        converted by llama.cpp's own converter from the native HF layout (EAGLE-3 heads: with
        the target's folder for the vocabulary), the target beside it in the cache, both in
        gguf_type. Writes <run>/export/<kind>-gguf/: draft-<type>.gguf, llamacpp.json (spec
        type, k, both files), config.yaml, README.md."""
        if why := self.why_not(kind):
            raise ConfigError(f"--format gguf: {why} Export it with --format vllm.")
        config = json.loads((Path(draft_folder) / "config.json").read_text())
        layers = config.get("num_hidden_layers", 1)
        outtype, spec_type = self.gguf_type, SPEC_TYPES[kind.name]
        if spec_type == "draft-eagle3" and layers != 1:
            raise ConfigError(f"--format gguf: the EAGLE-3 head in {draft_folder} has {layers} "
                              f"decoder layers and llama.cpp {VERSION} builds EAGLE-3 heads of "
                              "one (its eagle3 graph asserts n_layer == 1). Export it with "
                              "--format vllm, or train it with train.eagle3.layers=1.")
        unread = [name for name in UNREAD_EAGLE3_FIELDS if config.get(name)]
        if spec_type == "draft-eagle3" and unread:
            raise ConfigError(f"--format gguf: the head in {draft_folder} is an EAGLE 3.1 head "
                              f"({', '.join(unread)}), and llama.cpp {VERSION}'s eagle3 graph "
                              "(src/models/eagle3.cpp) reads norm_before_fc alone: it would "
                              "serve another head. Export it with --format vllm (vLLM reads "
                              "both), or train it with train.eagle3.fc_norm=false and "
                              "train.eagle3.norm_output=false.")
        resolved = resolve_target(cfg.model)
        kind.check_export(draft_folder, k, target_shape(resolved.path))
        out = Path(out or run_folder(cfg).export / f"{kind.name}-gguf")
        with staged(out) as tmp:
            hf = tmp / "hf"
            shutil.copytree(draft_folder, hf)
            kind.write_export(draft_folder, hf, k, "vllm", target_hub_id(cfg) or resolved.path)
            target = target_gguf(cfg, outtype, log)
            draft = convert_to_gguf(hf, tmp / f"draft-{outtype}.gguf", outtype,
                                    Path(resolved.path) if spec_type in READS_TARGET else None,
                                    log=log)
            check_same_vocabulary(target, draft)
            shutil.rmtree(hf)
            command = server_command(target, out / draft.name, spec_type, k,
                                     cfg.model.chat_template_kwargs)
            (tmp / CONFIG_NAME).write_text(json.dumps(
                {"spec_type": spec_type, "num_speculative_tokens": k, "draft": draft.name,
                 "target": str(target), "outtype": outtype, "llama.cpp": VERSION,
                 "command": command}, indent=2) + "\n")
            cfg.save(tmp / "config.yaml")
            serving = "\n".join([
                "## Serve it with llama.cpp", "",
                f"This folder holds the draft as GGUF ({outtype}), converted by llama.cpp "
                f"{VERSION}'s `convert_hf_to_gguf.py`; k = {k} draft tokens per step:", "",
                "```bash", command, "```"])
            (tmp / "README.md").write_text(model_card(cfg, kind, draft_folder, spec_type,
                                                      serving, resolved.name))
        return Export(out, spec_type, k, str(target), command)

    def exported(self, cfg: Config, folder: Path | None) -> Exported:
        folder = single_export(cfg, folder, CONFIG_NAME, "serving.export --format gguf")
        spec = json.loads((folder / CONFIG_NAME).read_text())
        if spec["outtype"] != "f32":
            raise ConfigError(f"{folder} holds {spec['outtype']} weights: the comparison with "
                              "our fp32 engine needs f32 (serving.export --format gguf "
                              "--gguf-type f32).")
        target, draft = Path(spec["target"]), folder / spec["draft"]
        for path in (target, draft):
            if not path.is_file():
                raise ConfigError(f"{path} is missing: export again (serving.export --format "
                                  "gguf).")
        check_same_vocabulary(target, draft)
        return Exported(folder, spec["spec_type"], spec["num_speculative_tokens"],
                        {**spec, "target": str(target), "draft": str(draft)})

    def our_counters(self, stats: list, k: int, max_new_tokens: int) -> list[Counters]:
        return [budgeted(s.accepted_per_step, max_new_tokens, k) for s in stats]

    def drafting(self, exported: Exported, settings: DecodeSettings) -> DecodeSettings:
        if self.draft_sampling == "greedy":
            return replace(settings, draft_temperature=0.0, draft_top_k=None)
        return replace(settings, draft_temperature=None, draft_top_k=DRAFT_TOP_K)

    def run(self, cfg: Config, exported: Exported, target_path: str, prompts: list[list[int]],
            settings: DecodeSettings, eos: set[int], with_draft: bool) -> EngineRun:
        """One request per prompt (no top-p, top-k or min-p: llama-server's own samplers
        off), counters read after each. The GGUF target, not target_path, is what it loads."""
        if settings.top_p < 1 or settings.top_k:
            raise ConfigError("the llama.cpp comparison samples at temperature alone: drop "
                              "--top-p and --top-k.")
        llama, k = ensure_llamacpp(), exported.k
        draft = Path(exported.spec["draft"]) if with_draft else None
        target = Path(exported.spec["target"])
        cache = _run_path(target, draft, exported.method, k, self.draft_sampling, prompts,
                          settings, cfg.run.seed)
        reused = cache.is_file()
        if reused:
            found = json.loads(cache.read_text())
            tokens, seconds = found["tokens"], found["seconds"]
            per_prompt = [Counters(*c) for c in found["per_prompt"]]
        else:
            server = LlamaServer(llama, target, draft, exported.method if draft else None, k,
                                 draft_sampling=self.draft_sampling)
            tokens, per_prompt = [], []
            with server:
                start, before = time.perf_counter(), server.counters()
                for j, prompt in enumerate(prompts):
                    tokens.append(server.complete(prompt, settings.max_new_tokens,
                                                  settings.temperature, seed=cfg.run.seed + j))
                    after = server.counters()
                    per_prompt.append(per_request(after, before, k))
                    before = after
                seconds = time.perf_counter() - start
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.with_suffix(".tmp").write_text(json.dumps(
                {"tokens": tokens, "seconds": seconds,
                 "per_prompt": [[c.drafts, c.accepted_per_position, c.drafted_per_position]
                                for c in per_prompt]}))
            cache.with_suffix(".tmp").replace(cache)
        run = EngineRun(tokens, seconds, reused=reused,
                        report={"llama_cpp_build_seconds": llama.build_seconds})
        if with_draft:
            run.per_prompt = per_prompt
            run.counters = summed(per_prompt, k)
            run.report.update(draft_sampling=self.draft_sampling,
                              drafting=f"--spec-draft-sampling {self.draft_sampling}")
        return run



def server_command(target: Path, draft: Path, spec_type: str, k: int,
                   chat_template_kwargs: dict) -> str:
    """llama-server serving the draft, with the chat mode it was trained in
    (model.chat_template_kwargs) as the server's chat template arguments."""
    chat_mode = (["--chat-template-kwargs", json.dumps(chat_template_kwargs, sort_keys=True)]
                 if chat_template_kwargs else [])
    return shlex.join(["llama-server", "-m", str(target), "-md", str(draft), "--spec-type",
                       spec_type, "--spec-draft-n-max", str(k), *chat_mode])


def _run_path(target: Path, draft: Path | None, method: str, k: int, draft_sampling: str,
              prompts: list[list[int]], settings: DecodeSettings, seed: int) -> Path:
    """Where a llama-server run is kept: its tokens and counters depend only on the GGUF files,
    the drafting, the prompts and the sampling (one seed per prompt), so a second check of the
    same export (another draft temperature on our side) or the target alone beside another
    draft skips llama.cpp's run. The key holds the llama.cpp version and each GGUF's size and
    modification time, so a re-converted file misses."""
    files = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in (target, draft) if f]
    drafting = [method, k, draft_sampling] if draft else None
    key = hashlib.sha256(json.dumps(
        [VERSION, files, drafting, prompts, settings.max_new_tokens, settings.temperature, seed]
    ).encode()).hexdigest()
    return cache_root() / "llamacpp-runs" / f"{key[:32]}.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on 127.0.0.1 for one target (and draft), one slot, greedy by default. At a
    request's temperature > 0 the draft proposes its argmax (draft_sampling 'greedy', llama.cpp's
    default) or samples its top 10 ('probabilistic', verified by rejection sampling).

    with LlamaServer(llama, target_gguf, draft_gguf, "draft-simple", k=3) as server:
        server.complete(prompt_ids, max_tokens=64) -> generated token ids
        server.counters() -> {"drafts", "draft_tokens", "accepted", "accepted_per_position"}
    """

    def __init__(self, llama: LlamaCpp, target: Path, draft: Path | None = None,
                 spec_type: str | None = None, k: int = 0, context: int = 2048,
                 threads: int | None = None, draft_sampling: str = "greedy",
                 p_min: float = 0.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(llama.server), "-m", str(target), "--host", "127.0.0.1",
                        "--port", str(self.port), "-c", str(context), "-np", "1", "--metrics",
                        "-t", str(threads or os.cpu_count() or 1), "--no-webui"]
        if spec_type is not None:  # a draft model (-md) or llama.cpp's own n-gram drafting
            # a fixed k unless p_min > 0 (a draft stopped at its first token below p_min: the
            # confidence head's estimate for draft-dspark); a short draft never discarded
            self.command += [*(["-md", str(draft)] if draft is not None else []),
                             "--spec-type", spec_type,
                             "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                             "--spec-draft-p-min", str(p_min),
                             "--spec-draft-sampling", draft_sampling]

    def __enter__(self) -> Self:
        import tempfile

        self.log = tempfile.TemporaryFile("w+")  # closed in __exit__
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                        stderr=self.log, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.output()
                self.log.close()
                raise RuntimeError(self._why(err) + f"\n{err[-3000:]}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not become healthy within 300 s: {self.command}")

    def output(self) -> str:
        """What llama-server logged so far."""
        self.log.flush()
        self.log.seek(0)
        text = self.log.read()
        self.log.seek(0, 2)
        return text

    def _why(self, err: str) -> str:
        if "unknown model architecture" in err:
            arch = re.search(r"unknown model architecture: '([^']+)'", err)
            return (f"this llama.cpp ({VERSION}) does not know the model architecture "
                    f"{arch.group(1) if arch else ''!r}: it cannot serve this draft.")
        return f"llama-server exited (code {self.process.returncode}) while loading"

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())

    def completion(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                   seed: int = 0, cache_prompt: bool = False) -> dict:
        """llama-server's reply to a token-id prompt (no template, no BOS added): its "tokens"
        and its own "timings"."""
        return self._post("/completion", {
            "prompt": prompt, "n_predict": max_tokens, "temperature": temperature,
            "seed": seed, "return_tokens": True, "cache_prompt": cache_prompt,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0})

    def complete(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[int]:
        """The generated token ids for a token-id prompt."""
        return list(self.completion(prompt, max_tokens, temperature, seed)["tokens"])

    def counters(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return spec_counters(r.read().decode())


def spec_counters(prometheus: str) -> dict:
    """llama-server's speculative counters -> our names. llama.cpp counts as vLLM does:
    `spec_decode_num_drafts_total` = target verification steps that carried a draft,
    `spec_decode_num_draft_tokens_total` = tokens drafted, `spec_decode_num_accepted_tokens_total`
    = drafted tokens the target accepted (bonus excluded), and
    `spec_decode_num_accepted_tokens_per_pos_total{position="j"}` = steps accepting position j
    (0-based). So tau = 1 + accepted / drafts and alpha_{j+1} = per_pos[j] / drafts."""
    values, per_position = {}, {}
    for line in prometheus.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        if match := re.fullmatch(r'llamacpp:spec_decode_num_accepted_tokens_per_pos_total'
                                 r'\{position="(\d+)"\}', name):
            per_position[int(match.group(1))] = float(value)
        else:
            values[name] = float(value)
    return {"drafts": int(values.get("llamacpp:spec_decode_num_drafts_total", 0)),
            "draft_tokens": int(values.get("llamacpp:spec_decode_num_draft_tokens_total", 0)),
            "accepted": int(values.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)),
            "accepted_per_position": [int(per_position[j]) for j in sorted(per_position)]}
