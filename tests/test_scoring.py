"""Prompt scoring (echo + logprobs, max_tokens 0, vLLM's prompt_logprobs): the engine's scoring prefill,
the runner's prompt event, and SmolLM2 behind a live server scored through the official openai client."""

from __future__ import annotations

import jax
import numpy as np
import openai
import pytest
from helpers import init_params, tiny_config
from http_helpers import LiveServer

from hkserve.api.app import create_app
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 3)
LONG_PROMPT = [(7 * i + 3) % 96 for i in range(40)]  # three chunks of the largest bucket (16)
NAME = "smollm2-135m-instruct"


def reference_logprobs(model, params, prompt: list[int]) -> np.ndarray:
    """log_softmax of the model's logits at every prompt position, one unpadded forward: [L, V]."""
    logits, _ = model.forward(
        params,
        np.asarray([prompt], np.int32),
        init_memory(model.config, 1, len(prompt)),
        np.asarray([len(prompt)], np.int32),
    )
    return np.asarray(jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1))


@pytest.fixture(scope="module")
def engine():
    return Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=64, prefill_buckets=(8, 16), n_top=4))


def test_scoring_prefill_equals_the_log_softmax_at_every_prompt_position(engine):
    pending, scores = engine.score_prefill(1, LONG_PROMPT)
    scored = scores.read()
    want = reference_logprobs(MODEL, PARAMS, LONG_PROMPT)
    assert [t.id for t in scored] == LONG_PROMPT[1:]
    for pos, t in enumerate(scored):  # token pos + 1, predicted at position pos
        row = want[pos]
        assert t.logprob == pytest.approx(row[t.id], abs=1e-5)
        assert t.rank == 1 + int(np.sum(row > row[t.id]))
        assert [i for i, _ in t.top] == list(np.argsort(-row)[:4])
        assert [lp for _, lp in t.top] == pytest.approx(np.sort(row)[::-1][:4], abs=1e-5)
    # the first token sampled is the plain prefill's
    assert pending.read()[0].id == engine.prefill(0, LONG_PROMPT).read()[0].id == int(np.argmax(want[-1]))


def test_plain_prefill_compiles_and_runs_no_scoring(engine):
    fresh = Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=64, prefill_buckets=(8, 16), n_top=4))
    fresh.prefill(0, LONG_PROMPT)
    assert {kind for kind, _ in fresh._compiled} == {
        "prefill",
        "table",
    }  # paged (the default): the block table's update


def test_runner_sends_the_scored_prompt_first_and_generates_the_same_tokens(engine):
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        plain = [e.token.id for e in runner.submit(Request(LONG_PROMPT, 5)) if e.token]
        events = list(runner.submit(Request(LONG_PROMPT, 5, logprobs=1, prompt_logprobs=2)))
        assert events[0].prompt is not None and [t.id for t in events[0].prompt] == LONG_PROMPT[1:]
        assert all(len(t.top) == 2 for t in events[0].prompt)
        assert [e.token.id for e in events[1:-1]] == plain
        assert events[-1].finish_reason == "length"

        # max_tokens 0: the prompt alone, even one that fills the whole context
        whole_context = (LONG_PROMPT * 2)[: engine.max_len]
        for prompt in (LONG_PROMPT, whole_context):
            events = list(runner.submit(Request(prompt, 0, prompt_logprobs=0)))
            assert [e.token for e in events] == [None, None]
            assert len(events[0].prompt) == len(prompt) - 1 and events[1].finish_reason == "length"
        with pytest.raises(ValueError, match="max_tokens must be at least 1"):
            runner.submit(Request(LONG_PROMPT, 0))
        with pytest.raises(ValueError, match="at most 4 top logprobs"):
            runner.submit(Request(LONG_PROMPT, 1, prompt_logprobs=5))
        # the runner still serves after prompt-only requests freed their slots at once
        assert [e.token.id for e in runner.submit(Request(LONG_PROMPT, 5)) if e.token] == plain
        assert runner.stats().running == 0
    finally:
        runner.stop()


@pytest.fixture(scope="module")
def live(smollm2):
    _, info, tokenizer, params = smollm2
    model = build_model(info.config)
    # buckets (8, 16): the golden chat prompt (37 tokens) is scored over three chunks
    engine = Engine(model, params, EngineOptions(slots=4, max_len=256, prefill_buckets=(8, 16), n_top=5))
    runner = InferenceRunner(engine).start(warmup=False)
    server = LiveServer(create_app(runner, tokenizer, NAME, engine.max_len))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield client, tokenizer, model, params
    server.stop()
    runner.stop()


def token_str(tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def test_echo_logprobs_of_the_golden_prompts_equal_the_models_log_softmax(live, golden):
    client, tokenizer, model, params = live
    for case in golden["cases"]:
        ids = case["prompt_ids"]
        want = reference_logprobs(model, params, ids)
        reply = client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=5, max_tokens=0)
        choice = reply.choices[0]
        lp = choice.logprobs
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length", case["name"]
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0
        assert lp.tokens == [token_str(tokenizer, i) for i in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.asarray(lp.token_logprobs[1:])
        np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, err_msg=case["name"])
        for pos, top in enumerate(lp.top_logprobs[1:]):
            best = np.argsort(-want[pos])[:5]
            assert top == pytest.approx({token_str(tokenizer, i): want[pos, i] for i in best}, abs=1e-4)
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_echo_logprobs_with_generation_continue_into_the_greedy_tokens(live, golden):
    client, tokenizer, _, _ = live
    case = golden["cases"][0]
    ids, greedy = case["prompt_ids"], case["greedy_ids"][:4]
    args = dict(model=NAME, prompt=case["prompt"], echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**args).choices[0]
    assert whole.text == case["prompt"] + tokenizer.decode(greedy)
    assert whole.logprobs.tokens == [token_str(tokenizer, i) for i in ids + greedy]
    assert whole.logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in whole.logprobs.tokens[:-1]]))
    assert [lp for lp in whole.logprobs.token_logprobs[len(ids) :]] == pytest.approx(
        [top[0][1] for top in case["top5"][:4]], abs=2e-3
    )
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for s in streamed for x in getattr(s, field)] == getattr(whole.logprobs, field)


def test_vllm_prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_top(live, golden):
    client, tokenizer, model, params = live
    case = next(c for c in golden["cases"] if "messages" in c)
    ids = case["prompt_ids"]
    want = reference_logprobs(model, params, ids)
    reply = client.completions.create(
        model=NAME, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    choice = reply.choices[0]
    assert choice.logprobs is None and choice.text == tokenizer.decode(case["greedy_ids"][:1])
    scored = choice.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for pos, (token_id, entry) in enumerate(zip(ids[1:], scored[1:])):
        row = want[pos]
        best = [int(i) for i in np.argsort(-row)[:2]]
        assert set(entry) == {str(i) for i in [token_id, *best]}
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(row[token_id], abs=1e-4)
        assert mine["rank"] == 1 + int(np.sum(row > row[token_id]))
        assert mine["decoded_token"] == token_str(tokenizer, token_id)
        assert [entry[str(i)]["rank"] for i in best] == [1, 2]


def test_max_tokens_zero_needs_echo_or_prompt_logprobs(live):
    client, _, _, _ = live
    with pytest.raises(openai.BadRequestError, match="needs echo or prompt_logprobs"):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=0)
    echoed = client.completions.create(model=NAME, prompt="Hi there", echo=True, max_tokens=0)
    assert echoed.choices[0].text == "Hi there" and echoed.choices[0].logprobs is None
