"""The HTTP side of `hkserve bench serve`: streaming completion requests from client threads, over one
httpx client, to the server it started; a refused request is counted and a 429 (or an attempt that got
no answer) retried as bench/refusals.py says, so an overloaded server's phase completes."""

from __future__ import annotations

import json
import time

from hkserve.bench.clients import run_clients
from hkserve.bench.phase import Load, measure
from hkserve.bench.refusals import CONNECTION_ERROR, STREAM_ERROR, Outcome, Refused, retry_after, streamed, with_retries
from hkserve.bench.watch import scrape
from hkserve.bench.workload import LONG_SEED, Job, LongPrompts

KEEPALIVE_S = 1.0  # an idle connection's life in the client's pool: under the server's keep_alive_s (api/limits.py)


def completion_body(model: str, job: Job, seed: int) -> dict:
    """The request bench serve sends for `job`: temperature 0.8, its seed, exactly its reply length."""
    return {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def attempt(client, url: str, body: dict) -> Outcome:
    """One streamed POST of `body` to url/v1/completions → its Outcome. Refused on a non-2xx answer (with
    its Retry-After), on no answer at all (CONNECTION_ERROR: a keep-alive connection the server had just
    closed, or a server gone), or on an error event or a broken connection inside the stream."""
    import httpx

    start = time.perf_counter()
    try:
        resp = client.send(client.build_request("POST", url + "/v1/completions", json=body), stream=True)
    except httpx.TransportError as e:
        raise Refused(CONNECTION_ERROR) from e
    arrivals, tokens = [], 0
    try:
        if not resp.is_success:
            resp.read()
            raise Refused(str(resp.status_code), retry_after(resp.headers.get("retry-after")))
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise Refused(STREAM_ERROR)
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    except httpx.TransportError as e:  # the stream broke off after its head: the reply failed
        raise Refused(STREAM_ERROR) from e
    finally:
        resp.close()
    return streamed(start, arrivals, tokens)


def http_phase(url: str, model: str, load: Load, jobs: list[Job], long: LongPrompts | None = None) -> dict:
    """`load`'s clients send its requests (request i: jobs[i % len(jobs)], seed i), with a new `long()`
    every `load.every` seconds beside them → phase.summarize's figures. One client object for the phase,
    as an OpenAI SDK client holds one: a fresh `httpx.Client` per request costs ~35 ms of CPU (its SSL
    context), which 16 clients starting at once took from the server's first prefill and counted as TTFT."""
    import httpx  # the HTTP client of the test extra, kept out of the import path of a server install

    # No cap on connections: long prompts in flight together each get one at once, as open-loop arrivals.
    # No cap on idle ones: httpcore 1.0.9's pool closes a surplus idle connection even when it has just
    # handed it to a waiting thread (encode/httpcore#1110), which hundreds of refused long prompts made
    # happen here (httpx.ReadError: Bad file descriptor). Idle ones expire well before the server's
    # keep-alive (5 s) would close them under a request (a CONNECTION_ERROR, retried, if it still does).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S)
    with httpx.Client(timeout=600, limits=limits) as client:

        def one(job: Job, seed: int, stop) -> Outcome:
            return with_retries(
                lambda: attempt(client, url, completion_body(model, job, seed)), stop.wait, load.retries
            )

        return measure(
            lambda stop: run_clients(
                load.concurrency, load.requests, lambda i: one(jobs[i % len(jobs)], i, stop), stop
            ),
            lambda: scrape(url),
            load.every,
            lambda k, stop: one(long(), LONG_SEED + k, stop),
            load.duration,
        )
