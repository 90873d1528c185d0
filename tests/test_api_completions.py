"""/v1/completions' defaults and limits against a fake runner: max_tokens 16 unless asked (chat: to the
context), max_tokens 0 only for the prompt alone, echo with logprobs asks the runner to score the prompt."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import FakeRunner, LiveServer, validate

from hkserve.api.app import create_app

MAX_LEN = 256


@pytest.fixture(scope="module")
def server(smollm2):
    tokenizer = smollm2[2]
    runner = FakeRunner(tokenizer.encode(" and so on," * 20) + [tokenizer.eos_id])
    server = LiveServer(create_app(runner, tokenizer, "fake", MAX_LEN))
    yield server, runner, tokenizer
    server.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def test_completions_default_to_16_tokens_and_chat_to_the_context(server):
    live, runner, tokenizer = server
    reply = post(live, "/v1/completions", {"prompt": "Once"}).json()
    assert runner.submitted[-1].max_tokens == 16
    assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "length"

    near_the_end = [5] * (MAX_LEN - 6)  # the default is shortened to what fits, not refused
    assert post(live, "/v1/completions", {"prompt": near_the_end}).status_code == 200
    assert runner.submitted[-1].max_tokens == 6

    messages = [{"role": "user", "content": "Once"}]
    reply = post(live, "/v1/chat/completions", {"messages": messages}).json()
    assert runner.submitted[-1].max_tokens == MAX_LEN - len(tokenizer.encode_chat(messages))
    assert reply["usage"]["completion_tokens"] > 16 and reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body,scoring",
    [
        ({"echo": True, "logprobs": 3}, 3),
        ({"echo": True, "logprobs": 0, "max_tokens": 0}, 0),
        ({"echo": True, "max_tokens": 0}, 0),
        ({"prompt_logprobs": 2, "logprobs": 4}, 2),
        ({"echo": True, "logprobs": 1, "prompt_logprobs": 4}, 4),
        ({"logprobs": 3}, None),  # logprobs without echo: the completion's only
        ({"echo": True}, None),
    ],
)
def test_what_asks_the_runner_to_score_the_prompt(server, body, scoring):
    live, runner, _ = server
    r = post(live, "/v1/completions", {"prompt": "Once upon", **body})
    assert r.status_code == 200, r.text
    assert runner.submitted[-1].prompt_logprobs == scoring


@pytest.mark.parametrize(
    "body,message",
    [
        ({"max_tokens": 0}, "needs echo or prompt_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_scoring_requests_are_400s(server, body, message):
    live, _, _ = server
    r = post(live, "/v1/completions", {"prompt": "x", **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    validate(r.json(), "ErrorResponse")
