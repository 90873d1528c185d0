"""The real default model against Hugging Face transformers' reference outputs (smollm2_golden.json)."""

from __future__ import annotations

import time

import pytest
from helpers import hkserve

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def runner(smollm2):
    _, info, _, params = smollm2
    runner = InferenceRunner(Engine(build_model(info.config), params, EngineOptions(slots=1, max_len=512))).start(
        warmup=False
    )
    yield runner
    runner.stop()


def prompt_ids(tokenizer, case) -> list[int]:
    if "messages" in case:
        assert tokenizer.render_chat(case["messages"]) == case["rendered_prompt"]
        return tokenizer.encode_chat(case["messages"])
    return tokenizer.encode(case["prompt"])


def test_tokenization_matches_reference_for_every_case(smollm2, golden):
    tokenizer = smollm2[2]
    for case in golden["cases"]:
        assert prompt_ids(tokenizer, case) == case["prompt_ids"], case["name"]
        assert tokenizer.decode(case["greedy_ids"]) == case["text"], case["name"]


def test_greedy_kv_decoding_equals_reference_tokens_and_top5_logprobs(smollm2, golden, runner):
    tokenizer = smollm2[2]
    for case in golden["cases"]:
        tokens = runner.generate(
            Request(case["prompt_ids"], 32, SamplingParams(temperature=0.0), tokenizer.stop_ids, logprobs=5)
        )
        assert [t.id for t in tokens] == case["greedy_ids"], case["name"]
        for step, (token, reference) in enumerate(zip(tokens, case["top5"])):
            ours = dict(token.top)
            fifth = min(ours.values())
            for token_id, logprob in reference:
                if token_id in ours:
                    assert abs(ours[token_id] - logprob) < LOGPROB_TOL, (case["name"], step, token_id)
                else:  # a near-tie at the 5th place may order differently: it must tie with our 5th
                    assert abs(logprob - fifth) < LOGPROB_TOL, (case["name"], step, token_id)
            assert abs(token.logprob - dict(reference)[token.id]) < LOGPROB_TOL


@pytest.mark.parametrize("index", range(4))
def test_generate_cli_prints_reference_text(smollm2_home, golden, index):
    case = golden["cases"][index]
    if "messages" in case:
        (message,) = case["messages"]
        args = ["generate", message["content"], "--chat"]
    else:
        args = ["generate", case["prompt"]]
    # float32 as the reference (a GPU would default to bf16)
    result = hkserve(*args, "--temperature", "0", "--max-tokens", "32", "--weights", "f32", home=smollm2_home)
    assert result.stdout == case["text"] + "\n"


def test_second_pull_is_a_no_op(smollm2_home):
    params_dir = smollm2_home / "models" / "smollm2-135m-instruct" / "params"
    before = params_dir.stat().st_mtime_ns
    result = hkserve("pull", home=smollm2_home)
    assert "already in the store" in result.stderr  # no wall-clock bound: it is no proof on a loaded machine
    assert params_dir.stat().st_mtime_ns == before


def test_models_lists_the_pulled_model(smollm2_home):
    out = hkserve("models", home=smollm2_home).stdout
    assert out.startswith("smollm2-135m-instruct\t")


@pytest.mark.slow  # ~90 s; test_runner_scheduling.py checks cancel timing on the FakeEngine in seconds
def test_200_requests_with_random_cancels_end_once_and_leave_no_slot_behind(smollm2, golden):
    import random
    import threading

    _, info, tokenizer, params = smollm2
    runner = InferenceRunner(
        Engine(build_model(info.config), params, EngineOptions(slots=4, max_len=256, prefill_buckets=(16, 64))),
        max_queue=256,
    ).start(warmup=False)
    rng = random.Random(1)
    try:
        streams = []
        for i in range(200):
            prompt = golden["cases"][i % 4]["prompt_ids"][: rng.randrange(1, 40)]
            sampling = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i)
            streams.append(runner.submit(Request(prompt, rng.randrange(1, 9), sampling, tokenizer.stop_ids)))
        doomed = rng.sample(streams, 60)

        def cancel_later():
            for stream in doomed:
                time.sleep(rng.uniform(0, 0.05))
                runner.cancel(stream.request.id)

        canceller = threading.Thread(target=cancel_later)
        canceller.start()
        for stream in streams:
            events = list(stream)
            finals = [e for e in events if e.finish_reason is not None]
            tokens = [e for e in events if e.token is not None]
            assert len(finals) == 1 and events[-1] is finals[0]
            reason = finals[0].finish_reason
            assert reason in ("stop", "length", "cancelled"), finals[0]
            assert len(tokens) <= stream.request.max_tokens
            if reason == "length":
                assert len(tokens) == stream.request.max_tokens
            if reason == "stop":
                assert tokens[-1].token.id in tokenizer.stop_ids
            if reason == "cancelled":
                assert stream in doomed
        canceller.join()
        assert sum(1 for s in streams if s.done) == 200
        for case in golden["cases"]:  # still exact afterwards
            got = runner.generate(Request(case["prompt_ids"], 32, SamplingParams(), tokenizer.stop_ids))
            assert [t.id for t in got] == case["greedy_ids"], case["name"]
    finally:
        runner.stop(timeout=300)
    # The loop thread has ended, its last snapshot published: read without racing its next iteration.
    assert runner.stats() == (4, 0, 0)
