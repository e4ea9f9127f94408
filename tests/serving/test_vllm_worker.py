"""The vLLM worker process kept between requests, without vLLM: its protocol (one request
per stdin line, "done" on the reply pipe), a failing request reported with its root cause, and
a fresh worker for the next request and for another environment (not for another test's name
in PYTEST_CURRENT_TEST)."""

import json
import os
import sys
import threading

import pytest

from serving.engines import vllm as engine
from serving.engines import vllm_worker

FAKE = """
import json, os, sys
reply = os.fdopen(int(sys.argv[-1]), "w")
for line in sys.stdin:
    request_path, result_path = json.loads(line)
    request = json.load(open(request_path))
    if request.get("fail"):
        print("ValueError: the target folder holds no config.json", flush=True)
        sys.exit(3)
    json.dump({"pid": os.getpid(), "echo": request["n"]}, open(result_path, "w"))
    reply.write("done\\n")
    reply.flush()
"""


@pytest.fixture
def fake_worker(monkeypatch, tmp_path):
    """run_worker's process replaced by FAKE (same protocol, no vLLM)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    real = engine.subprocess.Popen

    def popen(argv, **kwargs):
        return real([sys.executable, str(script), argv[-1]], **kwargs)

    monkeypatch.setattr(engine.subprocess, "Popen", popen)
    yield
    engine.stop_worker()


def test_one_worker_answers_request_after_request_and_a_failure_names_its_cause(fake_worker,
                                                                                tmp_path):
    first = engine.run_worker({"n": 1}, tmp_path)
    second = engine.run_worker({"n": 2}, tmp_path)
    assert (first["echo"], second["echo"]) == (1, 2) and first["pid"] == second["pid"]
    log = engine._worker.log
    with pytest.raises(RuntimeError, match=r"vLLM failed \(exit 3\): ValueError: the target "
                                           "folder holds no config.json"):
        engine.run_worker({"fail": True}, tmp_path)
    assert engine._worker is None and not log.exists()
    again = engine.run_worker({"n": 3}, tmp_path)  # a fresh worker
    assert again["echo"] == 3 and again["pid"] != first["pid"]
    other = engine.run_worker({"n": 4}, tmp_path / "other-cache")  # another environment
    assert other["pid"] != again["pid"]


def test_the_worker_is_kept_across_tests_and_replaced_when_a_variable_vllm_may_read_changes(
        fake_worker, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::one (call)")
    first = engine.run_worker({"n": 1}, tmp_path)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::two (call)")  # pytest, per test
    assert engine.run_worker({"n": 2}, tmp_path)["pid"] == first["pid"]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert engine.run_worker({"n": 3}, tmp_path)["pid"] != first["pid"]


def test_the_worker_loop_replies_done_after_each_result(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_worker, "run", lambda request: {"twice": 2 * request["n"]})
    read, write = os.pipe()
    requests = []
    for n in (1, 2):
        path = tmp_path / f"request{n}.json"
        path.write_text(json.dumps({"n": n}))
        requests.append(json.dumps([str(path), str(tmp_path / f"result{n}.json")]) + "\n")
    stdin_read, stdin_write = os.pipe()
    os.write(stdin_write, "".join(requests).encode())
    os.close(stdin_write)
    monkeypatch.setattr(sys, "stdin", os.fdopen(stdin_read))
    server = threading.Thread(target=vllm_worker.serve, args=(write,))
    server.start()
    with os.fdopen(read) as replies:
        assert replies.read() == "done\ndone\n"
    server.join()
    assert [json.loads((tmp_path / f"result{n}.json").read_text()) for n in (1, 2)] == [
        {"twice": 2}, {"twice": 4}]
