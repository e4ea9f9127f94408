"""The OpenAI-compatible server, driven by the official openai client over 127.0.0.1: a tiny
random target, its first layer as a draft ('first') and a copy of itself ('self', every token
accepted)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from recipe import load_config
from serving.server import Background, Limits, Served, create_app

KEY = "test-key"


class _Server:
    def __init__(self, served, limits, api_key=KEY):
        self.app = create_app(served, limits, api_key)
        self._background = Background(self.app)
        self.url = self._background.__enter__()

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)

    def close(self):
        self._background.__exit__(None, None, None)


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    cfg = load_config(None, [f"model.target={tiny_target}",
                             f"run.output_dir={tmp_path_factory.mktemp('run')}"])
    torch.manual_seed(0)
    return Served(cfg, {"first": "layer-truncated:1", "self": str(tiny_target)},
                  torch.device("cpu"))


@pytest.fixture(scope="module")
def server(served):
    s = _Server(served, Limits(max_queue=16, max_batch=8, max_tokens=256))
    yield s
    s.close()


CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def _chat(client, served, stream=False, **extra):
    body = {"model": served.model_id, "messages": CHAT,
            "max_tokens": extra.pop("max_tokens", 24),
            "temperature": extra.pop("temperature", 0.0)}
    if "seed" in extra:
        body["seed"] = extra.pop("seed")
    if "stop" in extra:
        body["stop"] = extra.pop("stop")
    if stream:
        chunks = list(client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body=extra))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, finish, chunks[-1].usage, chunks
    r = client.chat.completions.create(**body, extra_body=extra)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage, None


def test_chat_completions_models_and_the_speculation_usage(server, served):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [served.model_id]
    text, _, usage, _ = _chat(client, served, draft_model="self", max_speculative_tokens=4)
    extra = usage.model_extra
    assert usage.completion_tokens > 0 and usage.total_tokens == (usage.prompt_tokens
                                                                  + usage.completion_tokens)
    assert extra["speculative_decoding"] and extra["draft_model"] == "self"
    # the target drafting for itself: every draft token accepted (the last step may end early)
    assert extra["accepted_tokens"] >= extra["drafted_tokens"] - 4 > 0
    assert extra["tau"] > 3.0
    assert extra["latency_ms"] >= extra["time_to_first_token_ms"] > 0
    plain = _chat(client, served, speculative_decoding=False)
    assert plain[0] == text and plain[2].model_extra["tau"] is None
    assert plain[2].model_extra["drafted_tokens"] == 0

    r = client.completions.create(model=served.model_id, prompt="The sea is", max_tokens=12,
                                  temperature=0.0, extra_body={"draft_model": "ngram"})
    assert r.object == "text_completion" and r.usage.completion_tokens > 0
    assert r.usage.model_extra["draft_model"] == "ngram"


def test_greedy_text_is_the_same_for_every_k_and_when_streamed(server, served):
    client = server.client()
    reference = _chat(client, served, max_tokens=40, max_speculative_tokens=0)
    assert reference[2].model_extra["speculative_decoding"] is False
    for k in (2, 4, 8):
        for draft in ("first", "self", "ngram"):
            text, finish, usage, _ = _chat(client, served, max_tokens=40, draft_model=draft,
                                           max_speculative_tokens=k)
            assert (text, finish) == reference[:2], (draft, k)
            assert usage.completion_tokens == reference[2].completion_tokens
            streamed, s_finish, s_usage, chunks = _chat(client, served, stream=True,
                                                        max_tokens=40, draft_model=draft,
                                                        max_speculative_tokens=k)
            assert (streamed, s_finish) == reference[:2], (draft, k, "stream")
            assert s_usage.completion_tokens == usage.completion_tokens
    # with the target drafting for itself, a step sends k+1 tokens in one chunk
    *_, chunks = _chat(client, served, stream=True, max_tokens=40, draft_model="self",
                       max_speculative_tokens=4)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and
             c.choices[0].delta.content]
    assert 1 < len(texts) < 40


def test_a_seeded_sampled_request_repeats_streamed_or_not(server, served):
    client = server.client()
    runs = [_chat(client, served, stream=stream, temperature=1.0, seed=7, max_tokens=30,
                  draft_model="first", max_speculative_tokens=3) for stream in (False, True)]
    assert runs[0][0] == runs[1][0] and runs[0][0]
    other = _chat(client, served, temperature=1.0, seed=8, max_tokens=30, draft_model="first")
    assert other[0] != runs[0][0]


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(server, served):
    client = server.client()
    whole = _chat(client, served, max_tokens=40)[0]
    stop = whole[len(whole) // 2: len(whole) // 2 + 3]
    assert len(stop) == 3
    for stream in (False, True):
        text, finish, _, _ = _chat(client, served, stream=stream, max_tokens=40, stop=[stop],
                                   draft_model="self")
        assert text == whole[:whole.index(stop)] and finish == "stop"


def _post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, headers=headers, timeout=60,
                      content=raw if raw is not None else json.dumps(body))


@pytest.mark.parametrize("body,key,raw,status,message", [
    ({"draft_model": "nope"}, KEY, None, 400, "draft_model 'nope' is not loaded"),
    ({"max_speculative_tokens": 99}, KEY, None, 400, "outside"),
    ({"max_speculative_tokens": -1}, KEY, None, 400, "outside"),
    ({"frequency_penalty": 1.0}, KEY, None, 400, "'frequency_penalty'=1.0 is not implemented"),
    ({"logprobs": True}, KEY, None, 400, "'logprobs'=True is not implemented"),
    ({"best_of": 2}, KEY, None, 400, "unknown field(s) ['best_of']"),
    ({"stop": "x" * 300}, KEY, None, 400, "1 to 256 characters"),
    ({"temperature": "hot"}, KEY, None, 400, "'temperature': input should be a valid number"),
    ({"max_tokens": 4.5}, KEY, None, 400, "'max_tokens': input should be a valid integer"),
    ({"logit_bias": {"11": 5}}, KEY, None, 400, "'logit_bias'={'11': 5.0} is not implemented"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, KEY, None, 400,
     "this server reads text alone"),
    ({"n": 2}, KEY, None, 400, "outside"),
    ({"model": "gpt-4"}, KEY, None, 404, "not served here"),
    ({"max_tokens": 100000}, KEY, None, 400, "outside"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, KEY, None, 400,
     "exceed the model's context"),
    ({}, None, None, 401, "API key"),
    ({}, "wrong", None, 401, "API key"),
    ({}, KEY, b"{not json", 400, "not valid JSON"),
    ({"messages": "hello"}, KEY, None, 400, "'messages' must be"),
])
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_keeps_serving(
        server, served, body, key, raw, status, message):
    full = {"model": served.model_id, "messages": CHAT, "max_tokens": 8, **body}
    r = _post(server, "/v1/chat/completions", full, key, raw)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert "Traceback" not in r.text
    ok = _post(server, "/v1/chat/completions", {"model": served.model_id, "messages": CHAT,
                                                "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200


def test_openai_fields_at_their_neutral_values_are_taken_and_the_schema_is_published(server,
                                                                                     served):
    r = _post(server, "/v1/chat/completions", {
        "model": served.model_id, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}],
        "max_tokens": 4, "temperature": 0, "logit_bias": {}, "presence_penalty": 0.0,
        "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0, "parallel_tool_calls": True,
        "user": "someone", "stream_options": None})
    assert r.status_code == 200, r.text
    schema = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert chat["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatRequest"}
    components = schema["components"]["schemas"]
    assert {"ChatRequest", "CompletionRequest", "Message", "TextPart"} <= set(components)
    assert components["ChatRequest"]["additionalProperties"] is False
    assert "messages" in components["ChatRequest"]["required"]


def test_a_server_without_a_trained_draft_needs_one_named(served):
    from serving.server import HTTPError, read_job

    saved, served.default_draft = served.default_draft, None
    try:
        job, _ = read_job({"messages": CHAT, "temperature": 0}, True, served, Limits(), None)
        assert job.draft is None  # plain decoding by default
        with pytest.raises(HTTPError, match="no trained draft"):
            read_job({"messages": CHAT, "speculative_decoding": True}, True, served, Limits(),
                      None)
        job, _ = read_job({"messages": CHAT, "temperature": 0, "draft_model": "ngram"},
                          True, served, Limits(), None)
        assert job.draft == "ngram"
    finally:
        served.default_draft = saved


def test_the_served_drafts_run_on_int8_weights_when_the_recipe_says_so(tiny_target, tmp_path):
    from decoding.quantise import Int8Linear
    from recipe import ConfigError

    cfg = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path}",
                             "eval.draft_weights=int8"])
    served = Served(cfg, {"first": "layer-truncated:1"}, torch.device("cpu"))
    first = served.drafts["first"]
    assert first.weights == "int8"
    assert any(isinstance(m, Int8Linear) for m in first.model.modules())
    assert served.drafts["ngram"].weights == "model"  # prompt lookup has no weights
    with pytest.raises(ConfigError, match="set eval.draft_weights=model"):
        Served(cfg, {"lookup": "prompt-lookup"}, torch.device("cpu"))


def test_concurrent_greedy_requests_are_batched_and_answer_as_alone(server, served):
    client = server.client()
    prompts = [f"Tell me about the number {i}." for i in range(6)]

    def ask(p):
        r = client.chat.completions.create(
            model=served.model_id, messages=[{"role": "user", "content": p}], max_tokens=24,
            temperature=0.0, extra_body={"draft_model": "first", "max_speculative_tokens": 3})
        return r.choices[0].message.content

    alone = [ask(p) for p in prompts]
    # Deterministic arrival: a blocker request (another batch key) holds the worker at its
    # first forward until all six are queued, so the next batch takes them together.
    scheduler = server.app.state.scheduler
    gate = threading.Event()
    before = len(scheduler.batches)

    def held(*_) -> None:  # a pre-hook returning a value would replace the forward's args
        gate.wait(60)

    hold = served.target.register_forward_pre_hook(held)
    try:
        with ThreadPoolExecutor(7) as pool:
            blocker = pool.submit(lambda: client.chat.completions.create(
                model=served.model_id, messages=CHAT, max_tokens=2, temperature=0.0,
                extra_body={"speculative_decoding": False}))
            _wait_for(lambda: scheduler.waiting() == 0 and scheduler.admitted() == 1)
            together = [pool.submit(ask, p) for p in prompts]
            _wait_for(lambda: scheduler.waiting() == len(prompts))
            gate.set()
            together = [f.result() for f in together]
            blocker.result()
    finally:
        gate.set()
        hold.remove()
    assert together == alone
    assert scheduler.batches[before:] == [1, len(prompts)]  # the blocker, then all six at once


def _wait_for(condition, seconds=60):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "the server did not reach the expected queue state"
        time.sleep(0.01)


def test_a_full_queue_answers_429_and_a_client_leaving_frees_its_slot(served):
    s = _Server(served, Limits(max_queue=1, max_batch=1, max_tokens=256))
    slow = served.target.register_forward_pre_hook(lambda *a: time.sleep(0.05))
    try:
        client = s.client()
        stream = client.chat.completions.create(
            model=served.model_id, messages=CHAT, max_tokens=200, temperature=0.0, stream=True,
            extra_body={"speculative_decoding": False})
        next(iter(stream))  # the request holds the only slot
        r = _post(s, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "busy" in r.json()["error"]["message"]
        stream.close()  # the client leaves mid-stream: its row ends, its slot frees
        busy = 1  # until the row ends, a poll can still meet the full queue
        deadline = time.time() + 30
        while True:
            r = _post(s, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                                  "temperature": 0})
            if r.status_code == 200 or time.time() > deadline:
                break
            assert r.status_code == 429
            busy += 1
            time.sleep(0.1)
        assert r.status_code == 200
        metrics = httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert f'draftsmith_requests_total{{endpoint="/v1/chat/completions",status="429"}} ' \
            f'{float(busy)}' in metrics
        assert "draftsmith_request_latency_seconds_bucket" in metrics
    finally:
        slow.remove()
        s.close()


def test_the_vllm_engine_command_serves_the_export_and_vllm_parses_it(tiny_target, tmp_path):
    """--engine vllm: vLLM's own server on the target with the exported speculative config;
    its argument parser (the pinned vLLM's) takes every flag we pass."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.engines.vllm import VLLM
    from serving.server import model_id

    def vllm_command(cfg, host, port):
        return VLLM().server_argv(cfg, model_id(cfg), host, port)

    cfg = load_config(None, [f"model.target={tiny_target}", f"run.output_dir={tmp_path}"])
    with pytest.raises(Exception, match="serving.export"):
        vllm_command(cfg, "127.0.0.1", 8001)
    folder = tmp_path / "export" / "eagle3"
    folder.mkdir(parents=True)
    (folder / "vllm_speculative_config.json").write_text(json.dumps(
        {"method": "eagle3", "num_speculative_tokens": 4}))
    command = vllm_command(cfg, "127.0.0.1", 8001)
    assert command[2:5] == ["serving.vllm_api", "--model", str(tiny_target)]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    assert args.speculative_config == {"method": "eagle3", "num_speculative_tokens": 4,
                                       "model": str(folder.resolve())}
    assert (args.host, args.port, args.dtype) == ("127.0.0.1", 8001, cfg.model.dtype)


def test_a_completion_returns_its_token_ids_when_asked_and_names_the_stops_it_serves(server,
                                                                                     served):
    prompt = served.tokenizer("The sea is", add_special_tokens=False)["input_ids"]
    body = {"model": served.model_id, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    r = _post(server, "/v1/completions", {**body, "return_token_ids": True,
                                          "stop_token_ids": sorted(served.eos)})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == r.json()["usage"]["completion_tokens"]
    assert served.text(choice["token_ids"]) == choice["text"]
    assert "token_ids" not in _post(server, "/v1/completions", body).json()["choices"][0]
    other = max(served.eos) + 1
    r = _post(server, "/v1/completions", {**body, "stop_token_ids": [other]})
    assert r.status_code == 400 and "end-of-turn tokens" in r.json()["error"]["message"]


def test_the_vllm_server_is_execd_with_the_chat_mode_vllm_parses(tiny_target, tmp_path,
                                                                  monkeypatch):
    """--engine vllm replaces this process by vLLM's server (a SIGTERM reaches vLLM; nothing is
    orphaned), with the recipe's chat mode as the server's default, which vLLM's parser reads."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving import server

    folder = tmp_path / "export" / "eagle3"
    folder.mkdir(parents=True)
    (folder / "vllm_speculative_config.json").write_text(json.dumps(
        {"method": "eagle3", "num_speculative_tokens": 4}))
    execd = []

    def execve(path, argv, env):
        execd.append((argv, env))
        raise SystemExit(0)

    monkeypatch.setattr(server.os, "execve", execve)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  target: {tiny_target}\n  chat_template_kwargs:\n"
                      f"    enable_thinking: false\nrun:\n  output_dir: {tmp_path}\n")
    with pytest.raises(SystemExit):
        server.main(["--config", str(recipe), "--engine", "vllm", "--api-key", "secret"])
    argv, env = execd[0]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    # the key reaches vLLM in its environment, not in the argv `ps` shows
    assert env["VLLM_API_KEY"] == "secret" and "secret" not in " ".join(argv)


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_read_whole(served):
    s = _Server(served, Limits(max_queue=4, max_batch=1, max_tokens=64, max_body_bytes=4096))
    try:
        def chunks():  # no Content-Length: only counting the body as it comes can refuse it
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(64):
                yield b"x" * 1024
            yield b'"}]}'

        r = httpx.post(s.url + "/v1/chat/completions", content=chunks(), timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"]
    finally:
        s.close()


def test_metrics_are_labelled_by_route_and_health_reflects_the_decoding_thread(served,
                                                                             monkeypatch):
    import serving.request

    s = _Server(served, Limits(max_queue=4, max_batch=1, max_tokens=64))
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        for path in ("/no/such/path", "/v1/../etc", "/random-1", "/random-2"):
            httpx.get(s.url + path, headers=headers)
        httpx.get(s.url + "/v1/models")  # no key: 401
        metrics = httpx.get(s.url + "/metrics", headers=headers).text
        assert 'endpoint="unmatched",status="404"' in metrics
        assert 'endpoint="unmatched",status="401"' in metrics
        assert "random-1" not in metrics and "/no/such/path" not in metrics

        def broken(*args, **kwargs):
            from jinja2 import TemplateError

            raise TemplateError("Conversation roles must alternate")

        monkeypatch.setattr(serving.request, "render", broken)
        r = _post(s, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
        assert r.status_code == 400 and "cannot render these messages" in r.text
        monkeypatch.undo()
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        s.app.state.scheduler.close()  # the decoding thread ends
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "decoding thread stopped" in r.json()["reason"]
    finally:
        s.close()


def test_a_bind_others_can_reach_without_a_key_is_warned_of():
    from serving.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("my-host.internal")


def test_fields_openai_clients_send_at_their_defaults_and_text_parts_are_taken(server, served):
    plain = _post(server, "/v1/chat/completions", {
        "model": served.model_id, "messages": CHAT, "max_tokens": 6, "temperature": 0})
    parts = [{"type": "text", "text": "Write a short poem "}, {"type": "text",
                                                                "text": "about the sea."}]
    r = _post(server, "/v1/chat/completions", {
        "model": served.model_id, "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6, "temperature": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
        "logprobs": False, "user": "someone"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
