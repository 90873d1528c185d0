"""The in-process side of `hkserve bench serve`: the same workload as its HTTP clients (prompts,
lengths, sampling, concurrency) submitted straight to an InferenceRunner in this process, so the
HTTP layer's cost is the ratio of the two figures of one run.

The engine is built as `hkserve serve` builds it (the weights and CPU kernels serve picks by default,
slots, context length, top logprobs), with `prefill_rows` as asked: 0 is the one-prompt-per-call prefill, so the
same workload measures batched prefill's effect on TTFT too.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from hkserve.api.protocol import domain_error
from hkserve.bench.clients import run_clients
from hkserve.bench.phase import Load, measure
from hkserve.bench.refusals import RETRIES, STREAM_ERROR, Outcome, Refused, retry_after, streamed, with_retries
from hkserve.bench.watch import Sample
from hkserve.bench.workload import LONG_SEED, Job, LongPrompts
from hkserve.checkpoint.store import ModelStore, serving_weights
from hkserve.engine.background_compile import Compiles
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Overloaded, Request
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels.dispatch import resolve
from hkserve.model.build import build_model
from hkserve.model.config import with_kv_dtype
from hkserve.model.packing import stored_packing
from hkserve.model.sampling import SamplingParams

SERVE_N_TOP = 20  # hkserve serve's --max-logprobs default


class KVOptions(NamedTuple):
    """The KV memory and the step's token budget of the server and of the in-process runners, the same for both."""

    layout: str  # "static" | "paged" (engine/kv_layout.py)
    cache_mb: float | None  # paged: the pool's MiB; None: its default
    block_size: int  # paged: tokens per block
    dtype: str = "auto"  # --kv-dtype: auto | f32 | bf16
    max_step_tokens: int | None = None  # a loop pass's tokens (runner.py); None: the runner's default

    def flags(self) -> tuple[str, ...]:
        """As `hkserve serve`'s flags."""
        mb = ("--kv-cache-mb", str(self.cache_mb)) if self.cache_mb is not None else ()
        step = ("--max-step-tokens", str(self.max_step_tokens)) if self.max_step_tokens is not None else ()
        return (
            "--kv-layout",
            self.layout,
            *mb,
            "--kv-block-size",
            str(self.block_size),
            "--kv-dtype",
            self.dtype,
            *step,
        )


def runner_engine(model: str, slots: int, prefill_rows: int, max_len: int, kv: KVOptions) -> Engine:
    """An engine built as `hkserve serve` builds it on one device with its default flags: the weights it
    serves (a quantized store's own precision on a CPU), the CPU kernels `--kernels auto` resolves
    (decode attention for float models too), int8/int4 read packed where the store keeps them so."""
    store = ModelStore()
    weights = serving_weights(store, model, None)
    config = with_kv_dtype(store.config(model, weights), kv.dtype)
    built = build_model(config, resolve("auto", config.dtype, config.memory))
    params = store.params(model, weights=weights, packing=stored_packing(built.prepare))
    options = EngineOptions(
        slots=slots,
        max_len=max_len,
        n_top=SERVE_N_TOP,
        prefill_rows=prefill_rows,
        kv_layout=kv.layout,
        kv_cache_mb=kv.cache_mb,
        block_size=kv.block_size,
    )
    return Engine(built, params, options)


def start_runner(
    model: str, slots: int, max_queue: int, prefill_rows: int, max_len: int, kv: KVOptions
) -> InferenceRunner:
    """A started runner over `runner_engine`, every program compiled first as the server compiles them
    (before and after its ready: mostly loads from the compile cache the server filled), so that no
    compile lands inside a measured phase."""
    engine = runner_engine(model, slots, prefill_rows, max_len, kv)
    compiles = Compiles(engine, "background")
    compiles.before_ready()
    compiles.run_pending()  # here, not on a thread: the runner starts once nothing is left
    return InferenceRunner(engine, max_queue=max_queue, max_step_tokens=kv.max_step_tokens).start(warmup=False)


def prompt_ids(model: str, prompts: list[str]) -> list[list[int]]:
    """The prompts as the server tokenizes a completion's prompt."""
    tokenizer = ModelStore().tokenizer(model)
    return [tokenizer.encode(p) for p in prompts]


def attempt(runner: InferenceRunner, job: Job, seed: int) -> Outcome:
    """One request as bench serve's HTTP client makes it (temperature 0.8, its seed, ignore_eos) → its
    Outcome; refused as the server would refuse it (the same status and Retry-After: api/protocol.py)."""
    request = Request(list(job.ids), job.max_tokens, SamplingParams(temperature=0.8, seed=seed))
    start = time.perf_counter()
    try:
        stream = runner.submit(request)
    except (Overloaded, ValueError) as e:  # what the server's Generation turns into an HTTP error
        error = domain_error(e)
        raise Refused(str(error.status), retry_after(error.headers.get("Retry-After"))) from e
    arrivals, tokens = [], 0
    for event in stream:
        if event.error:
            raise Refused(STREAM_ERROR)
        if event.token is not None:
            arrivals.append(time.perf_counter())
            tokens += 1
    return streamed(start, arrivals, tokens)


def one(runner: InferenceRunner, job: Job, seed: int, stop: threading.Event, retries: int = RETRIES) -> Outcome:
    """attempt() with bench/refusals.py's retries, none begun once `stop` is set."""
    return with_retries(lambda: attempt(runner, job, seed), stop.wait, retries)


def runner_clients(
    runner: InferenceRunner, jobs: list[Job], concurrency: int, requests: int | None, stop=None, retries=RETRIES
):
    """`concurrency` client threads, `requests` in all (request i: jobs[i % len(jobs)], seed i) until `stop`
    is set → the per-request Outcomes and the wall time."""
    stop = stop or threading.Event()
    return run_clients(concurrency, requests, lambda i: one(runner, jobs[i % len(jobs)], i, stop, retries), stop)


def runner_phase(runner: InferenceRunner, load: Load, jobs: list[Job], long: LongPrompts | None = None) -> dict:
    """The HTTP side's phase (bench/serve_http.py) with the runner in place of the server: its running
    count from the runner's stats, no preemptions counted (None)."""
    return measure(
        lambda stop: runner_clients(runner, jobs, load.concurrency, load.requests, stop, load.retries),
        lambda: Sample(runner.stats().running, None),
        load.every,
        lambda k, stop: one(runner, long(), LONG_SEED + k, stop, load.retries),
        load.duration,
    )
