"""A Transformer-VQ model served by the same Engine and runner as KV models: slots, bucketed (and
chunked) prefill, one sample step for all slots, continuous admission."""

from __future__ import annotations

import random
import threading

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_vq_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_vq_config(vocab_size=96, context_length=4096)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 3)
PROMPT = [5, 17, 33, 2, 64, 9, 11, 40, 3, 77]


@pytest.fixture(scope="module")
def runner():
    engine = Engine(MODEL, PARAMS, EngineOptions(slots=4, max_len=1024, prefill_buckets=(8, 16, 32)))
    assert engine.windows == (1024,)  # the VQ state has no length axis: one compiled step
    runner = InferenceRunner(engine, max_queue=64)
    runner.start()
    yield runner
    runner.stop()


@jax.jit
def _last_logits(tokens, length):
    """One fresh forward over a whole right-padded sequence [1, 96] (one compile for every length)."""
    return MODEL.forward(PARAMS, tokens, init_memory(CONFIG, 1, None), length, last_only=True)[0][0]


def greedy_by_recompute(prompt: list[int], n: int) -> list[int]:
    """Greedy continuation where every token comes from one fresh forward over the whole sequence."""
    seq = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, 96), np.int32)
        tokens[0, : len(seq)] = seq
        seq.append(int(np.argmax(_last_logits(tokens, np.asarray([len(seq)], np.int32)))))
    return seq[len(prompt) :]


def ids(tokens) -> list[int]:
    return [t.id for t in tokens]


def test_greedy_decode_through_the_engine_equals_recompute(runner):
    # 10-token prompt into a 16 bucket, then single-token steps; a 70-token prompt spans 3 chunks of 32.
    assert ids(runner.generate(Request(PROMPT, 12))) == greedy_by_recompute(PROMPT, 12)
    long_prompt = [(7 * i + 3) % CONFIG.vocab_size for i in range(70)]
    assert ids(runner.generate(Request(long_prompt, 6))) == greedy_by_recompute(long_prompt, 6)


def test_a_request_is_bit_identical_alone_or_among_others_and_slots_are_reset(runner):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    alone = [ids(runner.generate(Request(PROMPT, 20))), ids(runner.generate(Request(PROMPT[:5], 20, seeded)))]
    rng = random.Random(1)
    results = {}

    def run(name, request):
        results[name] = ids(runner.generate(request))

    threads = [
        threading.Thread(
            target=run,
            args=(
                f"noise{i}",
                Request(
                    [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(1, 90))],
                    rng.randrange(1, 30),
                    SamplingParams(temperature=1.0, seed=i),
                ),
            ),
        )
        for i in range(8)
    ]
    threads += [
        threading.Thread(target=run, args=("greedy", Request(PROMPT, 20))),
        threading.Thread(target=run, args=("seeded", Request(PROMPT[:5], 20, seeded))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # Every slot has held other sequences by now: a reused slot starts from an empty state.
    assert [results["greedy"], results["seeded"]] == alone
    assert ids(runner.generate(Request(PROMPT, 20))) == alone[0]
