"""Speculative decoding on SmolLM2: the golden cases and editing prompts give the same tokens with
speculation on and off (greedy and seeded), requests whose accepted run crosses max_tokens, EOS or a
stop string end where plain decoding ends them, and batch invariance holds with speculation on."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from hkserve.engine.completion import Completion
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

PARAGRAPH = (
    "Teh quick brown fox jumpd over the lazzy dog. It was a sunny day and the fox was verry happy. The dog, "
    "however, did not enjoy being jumpd over, and he barked loudly at the fox untill it ran away into the forrest."
)
CODE = "def area(width, height):\n    half = width / 2\n    return half * height\n"
EDITS = [
    "Fix the spelling in this paragraph and write it out in full:\n\n" + PARAGRAPH,
    "Add a docstring to this function and write out the whole function:\n\n" + CODE,
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


# SmolLM2 compiles and decodes slowly on a loaded 2-core machine: a limit for the module, not per call.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def engines(smollm2):
    _, info, tokenizer, params = smollm2
    plain = Engine(build_model(info.config), params, EngineOptions(slots=4, max_len=256, prefill_buckets=(64, 128)))
    return tokenizer, plain, SpeculativeEngine(plain, SpecConfig(k=4))


class Job(NamedTuple):
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] | None = None  # None: the tokenizer's
    stop: list[str] | None = None


def complete(engine, tokenizer, jobs: list[Job]) -> list[tuple]:
    """Run the jobs at once → per job (token ids, logprobs, text, finish reason, usage)."""
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        completions = []
        for job in jobs:
            ids = tokenizer.stop_ids if job.stop_ids is None else job.stop_ids
            stream = runner.submit(Request(job.prompt, job.max_tokens, job.sampling, ids))
            completions.append(Completion(stream, tokenizer, runner.cancel, job.stop))
        results = []
        for completion in completions:  # each stream queues its events: reading them in turn is fine
            tokens = [d.token for d in completion if d.token is not None]
            ids, logprobs = [t.id for t in tokens], [t.logprob for t in tokens]
            results.append((ids, logprobs, completion.text, completion.finish_reason, completion.usage()))
    finally:
        runner.stop()
    return results


def same(ours: list[tuple], theirs: list[tuple]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a[0] == b[0] and a[2:] == b[2:]
        assert a[1] == pytest.approx(b[1], abs=1e-4)  # logprobs: a [B, K+1] program rounds differently


def chat(tokenizer, text):
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def test_golden_cases_give_the_reference_tokens_greedy_and_the_plain_tokens_seeded(engines, golden):
    tokenizer, plain, spec = engines
    cases = golden["cases"]
    greedy = complete(spec, tokenizer, [Job(c["prompt_ids"], 32) for c in cases])
    for case, result in zip(cases, greedy):
        assert result[0] == case["greedy_ids"], case["name"]
    seeded = [Job(c["prompt_ids"], 32, SEEDED) for c in cases]
    same(complete(spec, tokenizer, seeded), complete(plain, tokenizer, seeded))


@pytest.mark.parametrize(
    "sampling",
    # seeded: slow, the golden cases' seeded run above checks spec == plain for sampling by default
    [SamplingParams(), pytest.param(SEEDED, marks=pytest.mark.slow)],
    ids=["greedy", "seeded"],
)
def test_editing_prompts_accept_drafts_and_give_the_plain_tokens(engines, sampling):
    tokenizer, plain, spec = engines
    jobs = [Job(chat(tokenizer, text), 40, sampling) for text in EDITS]
    before = spec.counts.accepted, spec.counts.verify_rows
    ours = complete(spec, tokenizer, jobs)
    accepted, verified = spec.counts.accepted - before[0], spec.counts.verify_rows - before[1]
    assert accepted > verified  # more than one accepted draft per verify step on average
    same(ours, complete(plain, tokenizer, jobs))


def test_an_accepted_run_crossing_max_tokens_eos_or_a_stop_string_ends_where_plain_decoding_does(engines):
    tokenizer, plain, spec = engines
    prompt = chat(tokenizer, EDITS[0])
    recording = Recording(spec)
    ((ids, *_),) = complete(recording, tokenizer, [Job(prompt, 40)])
    # The index at which each token's run began: the first token comes from the prefill (a run of one).
    starts, index = [0], 1
    for run in recording.runs:
        starts += [index] * run
        index += run
    inside = [i for i in range(1, len(ids)) if starts[i] < i and ids[i] not in ids[:i]]
    assert inside, recording.runs  # some run of several tokens holds a token seen for the first time
    cut = inside[0]
    stop_text = tokenizer.decode(ids[: cut + 1])[-4:]
    assert stop_text not in tokenizer.decode(ids[:cut])
    jobs = [Job(prompt, cut + 1), Job(prompt, 40, stop_ids=(ids[cut],)), Job(prompt, 40, stop=[stop_text])]
    ours = complete(spec, tokenizer, jobs)
    same(ours, complete(plain, tokenizer, jobs))
    assert [r[4]["completion_tokens"] for r in ours] == [cut + 1] * 3  # each ended at the token inside the run
    assert [r[3] for r in ours] == ["length", "stop", "stop"] and stop_text not in ours[2][2]


def test_batch_invariance_holds_with_speculation_on(engines):
    tokenizer, plain, spec = engines
    edit = Job(chat(tokenizer, EDITS[1]), 32, SEEDED)
    others = [Job(chat(tokenizer, "Tell me about the moon."), 32), Job(chat(tokenizer, EDITS[0]), 24)]
    (alone,) = complete(spec, tokenizer, [edit])
    together = complete(spec, tokenizer, [others[0], edit, others[1]])
    same([alone], [together[1]])
    same([alone], complete(plain, tokenizer, [edit]))
