"""What several test modules share: the repository root, prompt files, the one tiny-model
factory, killing a launcher's process tree, and a reference for greedy speculative counts."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from train.loop import reset_accelerate  # noqa: F401  (the tests' name for it)

ROOT = Path(__file__).resolve().parents[1]


def recipes(embedded: bool) -> list[Path]:
    """The shipped recipes whose target is embedded (True) or a real published model (False)."""
    import yaml

    return sorted(p for p in (ROOT / "configs").glob("*.yaml") if embedded == str(
        yaml.safe_load(p.read_text())["model"]["target"]).startswith("embedded:"))
"""The repository root: tests name configs/ and distill.py through it, never through the
working directory."""


def recipe_path(name: str) -> str:
    """The path of configs/<name>.yaml in the repository, whatever the working directory."""
    return str(ROOT / "configs" / f"{name}.yaml")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_records(n: int) -> list[dict]:
    """n small conversations, some with two user turns."""
    return [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": "an answer the target will replace"},
        *([{"from": "human", "value": "And times two?"}] if i % 2 else []),
    ]} for i in range(n)]


def tiny_llama(vocab_size: int, *, seed: int = 0, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, context: int = 1024, init: float = 0.2,
               **config):
    """A random Llama of `layers` x `hidden` (MLP 2 x hidden), seeded, in eval mode. A large
    `init` gives peaked logits, so greedy argmax has no near-ties; `config` adds LlamaConfig
    fields (eos_token_id, pad_token_id, tie_word_embeddings, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, initializer_range=init, **config)).eval()


def save_tiny_llama(folder: Path, tokenizer, **kwargs) -> Path:
    """tiny_llama with the tokenizer's vocabulary, saved with the tokenizer as an HF folder."""
    tiny_llama(len(tokenizer), **kwargs).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's and vLLM's workers leave the
    launcher's process group, so killing the group is not enough); ones already gone are
    skipped."""
    import psutil

    try:
        parent = psutil.Process(pid)
        processes = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@torch.no_grad()
def greedy_chain_counts(target, propose: Callable[[list[int], int], list[int]],
                        prompt: Sequence[int], k: int, max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> tuple[int, int]:
    """What greedy speculative decoding with a chain of k must count, computed the slow and
    obvious way (no KV cache, no batching, no engine): prompt -> (steps, accepted draft tokens).

    The first token is the target's argmax after the prompt; then each step asks
    propose(tokens so far, k) for k tokens, runs the target over everything, accepts the longest
    prefix equal to the target's argmax and adds the target's next token; a step's tokens after
    a stop token or past max_new_tokens are not emitted, but its accepted count stands."""
    def argmax_after(ids: list[int]) -> torch.Tensor:
        return target(torch.tensor([ids])).logits[0].argmax(-1)  # [T]

    prompt = list(prompt)
    output = [int(argmax_after(prompt)[-1])]
    steps = accepted = 0

    def stopped() -> bool:
        return output[-1] in stop_ids or len(output) >= max_new_tokens

    while not stopped():
        draft = [int(t) for t in propose(prompt + output, k)]
        assert len(draft) == k
        best = argmax_after(prompt + output + draft)[len(prompt) + len(output) - 1:]  # [k+1]
        n = next((i for i in range(k) if draft[i] != int(best[i])), k)
        steps, accepted = steps + 1, accepted + n
        for token in draft[:n] + [int(best[n])]:
            output.append(token)
            if stopped():
                break
    return steps, accepted


def greedy_lm_proposer(draft) -> Callable[[list[int], int], list[int]]:
    """propose() for greedy_chain_counts from a causal LM draft: its argmax k times."""
    @torch.no_grad()
    def propose(ids: list[int], k: int) -> list[int]:
        ids = list(ids)
        for _ in range(k):
            ids.append(int(draft(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-k:]
    return propose


def reference_tau(cfg, proposer_for: Callable) -> float:
    """tau of a greedy chain over a recipe's eval prompts, counted without the engine:
    proposer_for(target) gives greedy_chain_counts' propose()."""
    from assets.target import end_of_turn_ids, load_target, load_tokenizer, resolve_target
    from runfolder import load_eval_prompts

    resolved = resolve_target(cfg.model)
    target = load_target(resolved, "float32", torch.device("cpu"))
    tokenizer = load_tokenizer(resolved)
    prompts, _ = load_eval_prompts(cfg, tokenizer, None)
    propose = proposer_for(target)
    counts = [greedy_chain_counts(target, propose, p, cfg.eval.k, cfg.eval.max_new_tokens,
                                  end_of_turn_ids(target, tokenizer)) for p in prompts]
    return 1 + sum(a for _, a in counts) / sum(s for s, _ in counts)


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (<run>/run-<id>.wandb), read back without
    wandb's service: a 7-byte header, then LevelDB-log records (crc, length, type; 32 KiB
    blocks) holding wandb_internal_pb2.Record protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, rows = run_file.read_bytes(), []
    position, block, chunks = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            break
        body = data[position + 7:position + 7 + length]
        position += 7 + length
        chunks = body if kind in (1, 2) else chunks + body  # full / first : middle / last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    """step -> value of one scalar tag in the tensorboard event files under folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags().get("scalars", []):
            values.update({e.step: e.value for e in accumulator.Scalars(tag)})
    return values


def assert_same_state(got: dict, want: dict) -> None:
    """Two state dicts hold the same names and, under each, an equal tensor."""
    assert got.keys() == want.keys(), (f"missing {sorted(want.keys() - got.keys())}, "
                                       f"extra {sorted(got.keys() - want.keys())}")
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def fit_medusa_heads(target, sequences: list[list[int]], num_heads: int = 4, steps: int = 20,
                     lr: float = 3e-3, train_lm_heads: bool = True):
    """Medusa heads fitted for a few Adam steps to the given token sequences (the target's own
    greedy continuations): heads that are right often and, being small, not always, so a test
    with them exercises acceptance and rejection. Head j at position s predicts seq[s + 2 + j]."""
    import torch.nn.functional as F

    from drafts.medusa import MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, num_heads=num_heads)
    for head in heads.lm_heads:
        head.weight.requires_grad_(train_lm_heads)
    data = []
    for seq in sequences:
        seq = torch.tensor([seq])
        with torch.no_grad():
            data.append((seq[0], target(seq, output_hidden_states=True).hidden_states[-1][0]))
    optimizer = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = 0.0
        for seq, hidden in data:
            logits = heads(hidden)  # [heads, T, V]
            for j in range(num_heads):
                loss = loss + F.cross_entropy(logits[j, : len(seq) - 2 - j], seq[2 + j:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.eval()


def tiny_overrides(tiny_target: Path, prompts: Path, out: Path) -> list[str]:
    """A recipe shrunk to the tiny target: 24 new tokens, 6 optimizer steps of 2 x 2, fp32."""
    return [f"model.target={tiny_target}", f"data.sources=[{prompts}]", f"run.output_dir={out}",
            "data.max_prompts=null", "data.max_prompt_tokens=null", "data.held_out_fraction=0.25",
            "generation.max_new_tokens=24", "generation.top_k_logprobs=8", "generation.backend=hf",
            "train.draft=layer-truncated:1",
            "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
            "train.max_steps=6", "train.warmup_steps=1", "train.learning_rate=3e-3",
            "train.save_every=3", "train.eval_every=3", "train.eval_k=3",
            "train.mixed_precision=no"]


def entry_script():
    """distill.py as a module (the distill package has its name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("distill_recipe", ROOT / "distill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_of(cfg, accelerate_config: str | None = None, device: str | None = None):
    """The plan `distill.py --plan` makes of cfg: every stage's estimate, as the script names
    them."""
    from plan import make_plan

    return make_plan(cfg, entry_script().stage_estimates(), accelerate_config, device)


def run_recipe(argv: list) -> tuple[int, str, str]:
    """distill.py's main(argv) in this process -> (exit code, stdout, stderr): what a launch of
    the script gives, without paying for a new interpreter where a process proves nothing."""
    import contextlib
    import io

    module = entry_script()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = module.main([str(a) for a in argv])
    finally:
        reset_accelerate()
    return code, out.getvalue(), err.getvalue()


EAGLE3 = ("train.draft=eagle3", "train.aux_layers=[0,1,1]", "train.draft_vocab_size=1024",
          "train.eagle3.ttt_steps=3", "train.loss=fkl", "train.target_logits=online")
"""An EAGLE-3 head on the tiny target, trained in fp32 with online features and logits."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server or a launcher started next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config: str) -> list[str]:
    """`accelerate launch` with configs/accelerate/<config> on one host, its processes meeting
    at a free port rather than accelerate's default 29500, which another run may hold."""
    import sys

    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
            str(ROOT / "configs" / "accelerate" / config), "--main_process_port", str(free_port())]


VLLM_STAGE1 = ["data.max_prompts=8", "generation.max_new_tokens=32", "generation.batch_size=4",
               "model.dtype=float32", "generation.vllm_enforce_eager=true",
               "train.draft=layer-truncated:1"]
"""Stage 1 of the real SmolLM2 target in fp32, greedy, as the backends are compared on it."""
STAGE1_ROW = ["id", "input_ids", "loss_mask", "messages", "finish_reasons", "num_turns"]


def stage1_rows(out: Path) -> dict:
    """A run folder's stage-1 rows by id, the columns two backends must write alike."""
    from runfolder import read_columns

    return {r["id"]: {k: r[k] for k in STAGE1_ROW} for r in read_columns(out / "data", STAGE1_ROW)}


def write_six_conversations(run: Path) -> None:
    """Stage-1 shards of six one-turn conversations c0..c5 (c5 held out), conversation i having
    generated 10 * (i + 1) tokens: the data the reports over run folders are checked on."""
    from runfolder import ShardWriter

    writer = ShardWriter(run / "data", rank=0, shard_size=8, top_k=0)
    for i in range(6):
        writer.add({"id": f"c{i}", "source": "s", "split": "train" if i < 5 else "held_out",
                    "messages": "[]", "input_ids": [1, 2], "loss_mask": [0, 1], "num_turns": 1,
                    "generated_tokens": 10 * (i + 1), "retokenized_replies": 0,
                    "finish_reasons": ["stop"], "backend": "vllm"})
    writer.end_batch()
    writer.close()


def logged_chains(draft) -> list:
    """The (tokens, draft logits) of every chain the draft proposes from now on."""
    chains, propose = [], draft.propose

    def logged(*args, **kwargs):
        tokens, probs = propose(*args, **kwargs)
        chains.append((tokens.clone(), draft.draft_logits.clone()))
        return tokens, probs

    draft.propose = logged
    return chains


def target_hidden_of(target, ids, layers):
    """The target's hidden states of ids as the draft kinds read them (drafts.kind.TargetHidden:
    last, the aux layers concatenated, the input embeddings)."""
    from drafts.kind import TargetHidden, aux_features

    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return TargetHidden(out.hidden_states[-1], aux_features(out.hidden_states, layers),
                        target.get_input_embeddings()(ids))
