"""Stage 1 through OpenAI-compatible servers (generation.backend=openai): our server on a tiny
target writes the rows the transformers backend writes; retries, refusals and text-only servers
against small fake servers."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from recipe import ConfigError, GenerationConfig, load_config
from runfolder import read_columns, read_manifest, shard_files
from tests.helpers import chat_records, recipe_path, write_jsonl

EOS = 2  # the tiny target's end-of-turn id


def _config(tiny_target, prompts, out, *extra):
    return load_config(recipe_path("smollm2-135m-independent"), [
        f"model.target={tiny_target}", f"data.sources=[{prompts}]", f"run.output_dir={out}",
        "data.max_prompts=null", "data.held_out_fraction=0.25", "data.max_prompt_tokens=null",
        "generation.max_new_tokens=6", "model.dtype=float32", "generation.batch_size=4",
        "train.draft=layer-truncated:1", *extra])


@pytest.fixture(scope="module")
def our_server(tiny_target, tmp_path_factory):
    """serving.server on the tiny target, in this process."""
    from serving.request import Limits
    from serving.server import Background, Served, create_app

    cfg = load_config(None, [f"model.target={tiny_target}", "model.dtype=float32",
                             f"run.output_dir={tmp_path_factory.mktemp('served')}"])
    torch.manual_seed(0)
    served = Served(cfg, {}, torch.device("cpu"))
    with Background(create_app(served, Limits(max_queue=64, max_batch=8))) as url:
        yield url + "/v1", served


def _rows(out):
    rows = read_columns(out / "data", ["id", "input_ids", "loss_mask", "messages",
                                       "finish_reasons", "num_turns", "backend"])
    return {r["id"]: r for r in rows}


def test_stage1_through_our_server_writes_the_rows_the_hf_backend_writes_and_resumes(
        tiny_target, our_server, tmp_path):
    from accelerate import Accelerator

    from distill import run_distill
    from distill.remote import EndpointError

    url, served = our_server
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(10))
    local = run_distill(_config(tiny_target, prompts, tmp_path / "hf", "generation.backend=hf"),
                        Accelerator(cpu=True))
    out = tmp_path / "openai"
    unreachable = _config(tiny_target, prompts, out, "generation.backend=openai",
                          "generation.openai_endpoints=[http://127.0.0.1:9/v1]",
                          "generation.openai_max_retries=1")
    with pytest.raises(EndpointError, match=r"failed 2 times .*127.0.0.1:9.*run stage 1 again"):
        run_distill(unreachable, Accelerator(cpu=True))
    assert not shard_files(out / "data") and read_manifest(out)["status"] == "in_progress"

    cfg = _config(tiny_target, prompts, out, "generation.backend=openai",
                  f"generation.openai_endpoints=[{url}]", "generation.openai_concurrency=3")
    remote = run_distill(cfg, Accelerator(cpu=True))  # resumes the run refused above
    assert remote.manifest["status"] == "complete" and remote.generated_now == 10
    assert remote.manifest["generated_by"] == {"openai": 10}
    ours, theirs = _rows(local.output_dir), _rows(out)
    assert ours.keys() == theirs.keys()
    for i, row in theirs.items():
        assert row["backend"] == "openai"
        for key in ("input_ids", "loss_mask", "messages", "finish_reasons", "num_turns"):
            assert row[key] == ours[i][key], (i, key)
    assert remote.manifest["identity"] == local.manifest["identity"]  # how, not what, differs


def test_a_server_of_another_model_is_refused_by_name(tiny_target, our_server, tmp_path):
    from accelerate import Accelerator

    from distill import run_distill
    from distill.remote import EndpointError

    url, served = our_server
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_records(4))
    cfg = _config(tiny_target, prompts, tmp_path / "out", "generation.backend=openai",
                  f"generation.openai_endpoints=[{url}]",
                  "generation.openai_model=meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(EndpointError, match=rf"serves \['{served.model_id}'\], not the target "
                                            r".*Llama-3.1-8B-Instruct"):
        run_distill(cfg, Accelerator(cpu=True))


class Fake:
    """A scripted OpenAI server: answers[i] is the i-th completion's (status, body)."""

    def __init__(self, answers, model="tiny"):
        self.answers, self.calls, self.bodies = list(answers), 0, []
        self.retry_after = "0"
        self.app = FastAPI()

        @self.app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": model, "object": "model"}]}

        @self.app.post("/v1/completions")
        async def completions(request: Request):
            self.bodies.append(json.loads(await request.body()))
            status, body = self.answers[min(self.calls, len(self.answers) - 1)]
            self.calls += 1
            return JSONResponse(body, status_code=status,
                                headers={"Retry-After": self.retry_after})


def _completion(text="", token_ids=None, finish_reason="length", completion_tokens=None,
                **extra):
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, **extra}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    usage = {"completion_tokens": completion_tokens} if completion_tokens is not None else {}
    return 200, {"choices": [choice], "usage": usage}


def _generator(url, smollm2_tokenizer, **gen):
    from distill.remote import OpenAIGenerator

    gen = GenerationConfig(backend="openai", openai_endpoints=[url + "/v1"], max_new_tokens=4,
                           **gen)
    return OpenAIGenerator(gen, smollm2_tokenizer, {EOS}, ["tiny"])


def test_busy_and_failing_servers_are_retried_and_each_request_carries_its_seed(
        smollm2_tokenizer):
    from serving.server import Background

    fake = Fake([(429, {"error": "busy"}), (503, {"error": "restarting"}),
                 _completion("", token_ids=[5, 6, EOS], finish_reason="stop")])
    with Background(fake.app) as url:
        generator = _generator(url, smollm2_tokenizer)
        [reply] = generator.replies([[1, 2, 3]], [1234])
    assert (reply.token_ids, reply.finished, reply.finish_reason) == ([5, 6, EOS], True, "stop")
    assert generator.stats.retries == 2 and fake.calls == 3
    sent = fake.bodies[-1]
    assert sent["seed"] == 1234 and sent["prompt"] == [1, 2, 3] and sent["model"] == "tiny"
    assert sent["stop_token_ids"] == [EOS] and sent["return_token_ids"] is True
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 4


def test_a_client_error_stops_at_once_naming_the_server_and_its_answer(smollm2_tokenizer):
    from distill.remote import EndpointError
    from serving.server import Background

    fake = Fake([(401, {"error": "invalid API key"})])
    with Background(fake.app) as url:
        generator = _generator(url, smollm2_tokenizer)
        with pytest.raises(EndpointError, match=r"HTTP 401: .*invalid API key.*OPENAI_API_KEY"):
            generator.replies([[1, 2]], [0])
    assert fake.calls == 1


def test_replies_without_token_ids_or_finish_reason_are_recorded_as_such(smollm2_tokenizer):
    from serving.server import Background

    tok = smollm2_tokenizer
    text = "Hello there"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    fake = Fake([_completion(text, finish_reason="stop", completion_tokens=len(ids) + 1,
                             stop_reason=None),
                 _completion(text, finish_reason=None, completion_tokens=len(ids))])
    with Background(fake.app) as url:
        generator = _generator(url, tok, openai_concurrency=1)
        stopped, cut = generator.replies([[1], [1]], [0, 1])
    assert stopped.token_ids == ids + [EOS] and stopped.finished
    assert cut.token_ids == ids and not cut.finished and cut.finish_reason == "none"
    assert generator.stats.retokenized_mismatches == 0 and generator.stats.no_finish_reason == 1
    generator.check_retokenized()


def test_text_that_does_not_retokenize_to_the_servers_count_stops_the_run(smollm2_tokenizer):
    from distill.remote import EndpointError
    from serving.server import Background

    fake = Fake([_completion("Hello there", completion_tokens=3)])  # the text is 2 tokens
    with Background(fake.app) as url:
        generator = _generator(url, smollm2_tokenizer, openai_concurrency=4)
        generator.replies([[1]] * 19, list(range(19)))
        generator.check_retokenized()  # under 20 text-only replies: not judged yet
        generator.replies([[1]], [19])
        with pytest.raises(EndpointError, match=r"20 of 20 replies returned as text only"):
            generator.check_retokenized()


@pytest.mark.parametrize("overrides, message", [
    (["generation.backend=openai"], "needs generation.openai_endpoints"),
    (["generation.backend=openai", "generation.openai_endpoints=[localhost:8000]"],
     "must be an http"),
    (["generation.backend=openai", "generation.openai_endpoints=[http://h:1/v1]",
      "generation.top_k_logprobs=4"], "top_k_logprobs needs the target's logits"),
])
def test_an_openai_backend_without_what_it_needs_is_refused_at_config_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("body, problem", [
    ({"choices": []}, "no choices"),
    ({"usage": {}}, "no choices"),
    ({"choices": ["text"]}, "a choice that is not an object"),
    ({"choices": [{"token_ids": [5, 10**9], "finish_reason": "stop"}]},
     "token ids outside the target's vocabulary"),
    ({"choices": [{"token_ids": [5, "6"]}]}, "token ids outside"),
    ({"choices": [{"finish_reason": "stop"}]}, "neither token_ids nor text"),
])
def test_a_reply_that_is_no_completion_stops_stage_1_naming_the_server(smollm2_tokenizer, body,
                                                                      problem):
    from distill.remote import EndpointError
    from serving.server import Background

    fake = Fake([(200, body)])
    with Background(fake.app) as url:
        generator = _generator(url, smollm2_tokenizer)
        with pytest.raises(EndpointError, match=rf"{url}/v1 answered a completion with {problem}"):
            generator.replies([[1, 2]], [0])


def test_a_servers_retry_after_is_bounded(smollm2_tokenizer, monkeypatch):
    import distill.remote
    from serving.server import Background

    waits = []
    monkeypatch.setattr(distill.remote.time, "sleep", waits.append)
    fake = Fake([(503, {"error": "busy"}),
                 _completion("", token_ids=[5, EOS], finish_reason="stop")])
    fake.retry_after = "864000"  # ten days
    with Background(fake.app) as url:
        [reply] = _generator(url, smollm2_tokenizer).replies([[1]], [0])
    # (time.sleep is the time module's: the test server's own short polls are recorded too)
    assert reply.finished and [w for w in waits if w > 1] == [distill.remote.MAX_RETRY_AFTER_S]


def test_random_replies_are_a_reply_or_an_endpoint_error_and_nothing_else(smollm2_tokenizer):
    """checked_choice and the reply's reading under 2,000 seeded random completions (wrong
    types in every field: choices, token ids, text, finish and stop reasons, usage)."""
    import random

    from distill.remote import EndpointError, checked_choice
    from serving.server import Background
    from tests.serving.test_request_fuzz import junk

    with Background(Fake([]).app) as url:  # the served name, read once at start
        generator = _generator(url, smollm2_tokenizer)
    rng, outcomes = random.Random(0), {"reply": 0, "refused": 0}
    try:
        for _ in range(2000):
            choice = {key: junk(rng) for key in rng.sample(
                ["token_ids", "text", "finish_reason", "stop_reason", "index"], 3)}
            if rng.random() < 0.4:
                choice["token_ids"] = [rng.randrange(-2, 50000) for _ in range(rng.randrange(4))]
            answer = {"choices": [choice] if rng.random() < 0.9 else junk(rng),
                      "usage": junk(rng) if rng.random() < 0.5 else {"completion_tokens": 3}}
            try:
                reply = generator._to_reply(checked_choice(answer, len(smollm2_tokenizer), "s"),
                                            answer["usage"])
                assert all(isinstance(t, int) for t in reply.token_ids)
                outcomes["reply"] += 1
            except EndpointError:
                outcomes["refused"] += 1
    finally:
        generator.close()
    assert outcomes["reply"] > 100 and outcomes["refused"] > 100, outcomes
