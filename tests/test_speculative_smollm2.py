"""Speculative decoding on SmolLM2: the golden cases and editing prompts give the same tokens with
speculation on and off (greedy and seeded), requests whose accepted run crosses max_tokens, EOS or a
stop string end where plain decoding ends them, and batch invariance holds with speculation on."""

from __future__ import annotations

import pytest

from hkserve.engine.completion import Completion
from hkserve.engine.engine import Engine
from hkserve.engine.runner import InferenceRunner, Request
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

SENTENCE = (
    "Teh comunity garden meeting was held on Tuesday in the library. About thirty neighbours came, and most "
    "of them brought vegetables from there own plots to share with everyone."
)
CODE = "def area(x, h):\n    # x is the width\n    half = x / 2\n    return half * h + x * 0\n"
EDITS = [
    "Fix the spelling in this text and write it out in full:\n\n" + SENTENCE,
    "Rename the variable x to width in this code and write out the whole code:\n\n" + CODE,
]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, frequency_penalty=0.2, logit_bias={13: -2.0})


class Recording:
    """The speculative engine, noting how many tokens each step gave slot 0."""

    def __init__(self, spec: SpeculativeEngine):
        self.spec, self.runs = spec, []

    def __getattr__(self, name):
        return getattr(self.spec, name)

    def step(self, active):
        pending, runs = self.spec.step(active), self.runs

        class Read:
            def read(self):
                rows = pending.read()
                runs.append(len(rows[0]))
                return rows

        return Read()


@pytest.fixture(scope="module")
def engines(smollm2):
    _, info, tokenizer, params = smollm2
    plain = Engine(build_model(info.config), params, slots=2, max_len=256, prefill_buckets=(64, 128))
    return tokenizer, plain, SpeculativeEngine(plain, SpecConfig(k=4))


def complete(engine, tokenizer, prompt, max_tokens, sampling=SamplingParams(), stop_ids=None, stop=None, with_=()):
    """Run one request (with others alongside) → (token ids, logprobs, text, finish reason, usage)."""
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        ids = tokenizer.stop_ids if stop_ids is None else stop_ids
        others = [runner.submit(Request(p, max_tokens, sampling, tokenizer.stop_ids)) for p in with_]
        completion = Completion(
            runner.submit(Request(prompt, max_tokens, sampling, ids)), tokenizer, runner.cancel, stop
        )
        tokens = [d.token for d in completion if d.token is not None]
        for stream in others:
            list(stream)
    finally:
        runner.stop()
    usage = completion.usage()
    return [t.id for t in tokens], [t.logprob for t in tokens], completion.text, completion.finish_reason, usage


def chat(tokenizer, text):
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def test_golden_cases_give_the_reference_tokens_greedy_and_the_plain_tokens_seeded(engines, golden):
    tokenizer, plain, spec = engines
    for case in golden["cases"]:
        ids, *_ = complete(spec, tokenizer, case["prompt_ids"], 32)
        assert ids == case["greedy_ids"], case["name"]
        ours, theirs = (complete(e, tokenizer, case["prompt_ids"], 32, SEEDED) for e in (spec, plain))
        assert ours[0] == theirs[0], case["name"]
        assert ours[1] == pytest.approx(theirs[1], abs=1e-4)


@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_editing_prompts_accept_drafts_and_give_the_plain_tokens(engines, sampling):
    tokenizer, plain, spec = engines
    for text in EDITS:
        prompt = chat(tokenizer, text)
        before = spec.counts.accepted
        ours = complete(spec, tokenizer, prompt, 40, sampling)
        assert spec.counts.accepted > before, text  # drafts were accepted
        theirs = complete(plain, tokenizer, prompt, 40, sampling)
        assert ours[0] == theirs[0] and ours[2:] == theirs[2:]
        assert ours[1] == pytest.approx(theirs[1], abs=1e-4)


def test_an_accepted_run_crossing_max_tokens_eos_or_a_stop_string_ends_where_plain_decoding_does(engines):
    tokenizer, plain, spec = engines
    prompt = chat(tokenizer, EDITS[0])
    recording = Recording(spec)
    ids, *_ = complete(recording, tokenizer, prompt, 40)
    # Index of each token in its step's run: the first token comes from the prefill (a run of one).
    starts, index = [], 1
    for run in recording.runs:
        starts += [index] * run
        index += run
    inside = [i for i in range(1, len(ids)) if i < len(starts) and starts[i] < i and ids[i] not in ids[:i]]
    assert inside, recording.runs  # some run of several tokens holds a token seen for the first time
    cut = inside[0]
    stop_text = tokenizer.decode(ids[: cut + 1])[-4:]
    assert stop_text not in tokenizer.decode(ids[:cut])
    cases = {
        "max_tokens": {"max_tokens": cut + 1},
        "eos": {"max_tokens": 40, "stop_ids": (ids[cut],)},
        "stop string": {"max_tokens": 40, "stop": [stop_text]},
    }
    for name, case in cases.items():
        ours, theirs = (complete(e, tokenizer, prompt, sampling=SamplingParams(), **case) for e in (spec, plain))
        assert ours[0] == theirs[0] and ours[2:] == theirs[2:], name
        assert ours[4]["completion_tokens"] == cut + 1, name  # ended at the token inside the run
    assert ours[3] == "stop" and stop_text not in ours[2]


def test_batch_invariance_holds_with_speculation_on(engines):
    tokenizer, plain, spec = engines
    edit, other = chat(tokenizer, EDITS[1]), chat(tokenizer, "Tell me about the moon.")
    alone = complete(spec, tokenizer, edit, 32, SEEDED)
    together = complete(spec, tokenizer, edit, 32, SEEDED, with_=[other])
    reference = complete(plain, tokenizer, edit, 32, SEEDED)
    assert alone[0] == together[0] == reference[0]
    assert alone[1] == pytest.approx(together[1], abs=1e-4)
