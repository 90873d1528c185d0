"""`bench serve` against an overloaded server (bench/refusals.py): a refused request is counted by status,
a 429 retried after the server's Retry-After as a real client would, and the run completes with the
served requests' figures, on the HTTP side and the in-process runner's alike; the long prompts beside the
clients survive a 429 too. (The run once died on the first 429: `resp.raise_for_status()` in a client.)"""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from http_helpers import FakeRunner, LiveServer

from hkserve.api.app import create_app
from hkserve.bench.phase import Load, summarize
from hkserve.bench.refusals import Outcome, Refused, retry_after, with_retries
from hkserve.bench.serve_http import attempt, completion_body, http_phase
from hkserve.bench.serve_runner import attempt as runner_attempt
from hkserve.bench.serve_runner import runner_phase
from hkserve.bench.watch import Figures
from hkserve.bench.workload import LONG_SEED, Job, LongPrompts
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.requests import Overloaded

# what a client does with a refusal, on a scripted attempt and a recording wait


class Waits(list):
    """A wait(seconds) that records what it was asked and returns at once: True (stopped) or not."""

    def __init__(self, stopped: bool = False):
        super().__init__()
        self.stopped = stopped

    def __call__(self, seconds: float) -> bool:
        self.append(seconds)
        return self.stopped


class Attempts(Waits):
    """attempt() raising the scripted Refused's in order, then served; itself the recording wait."""

    def __init__(self, refusals: list[Refused], stopped: bool = False):
        super().__init__(stopped)
        self.refusals, self.wait, self.waits = list(refusals), self, self

    def attempt(self) -> Outcome:
        if self.refusals:
            raise self.refusals.pop(0)
        return Outcome(0.01, [0.02], 2)


def test_a_429_is_retried_after_its_retry_after_and_served():
    a = Attempts([Refused("429", 1.0), Refused("429", 1.0)])
    outcome = with_retries(a.attempt, a.wait, retries=2)
    assert outcome == Outcome(0.01, [0.02], 2, True, ("429", "429")) and a.waits == [1.0, 1.0]


def test_without_a_usable_retry_after_the_client_backs_off_exponentially():
    a = Attempts([Refused("429"), Refused("429", 120.0), Refused("429", -1.0), Refused("429")] + [Refused("429")] * 2)
    assert with_retries(a.attempt, a.wait, retries=6).served
    assert a.waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]  # capped at 8 s
    assert [retry_after(h) for h in ("1", "0.25", None, "Wed, 21 Oct 2015 07:28:00 GMT")] == [1.0, 0.25, None, None]


def test_a_request_refused_past_its_retries_or_with_another_status_is_given_up():
    a = Attempts([Refused("429", 1.0)] * 3)
    outcome = with_retries(a.attempt, a.wait, retries=2)
    assert not outcome.served and outcome.refusals == ("429",) * 3 and outcome.tokens == 0 and a.waits == [1.0] * 2
    for status in ("400", "500", "503", "stream_error"):  # only "try again later" is tried again
        a = Attempts([Refused(status, 1.0)])
        assert with_retries(a.attempt, a.wait).refusals == (status,) and a.waits == []
    a = Attempts([Refused("429", 1.0)], stopped=True)  # the phase stopped while it waited
    assert with_retries(a.attempt, a.wait).refusals == ("429",) and a.waits == [1.0]


def test_the_figures_are_the_served_requests_alone_and_refusals_are_counted_by_status():
    results = [
        Outcome(0.010, [0.02, 0.04], 3),
        Outcome(0.030, [0.06], 2, True, ("429",)),  # served after a retry
        Outcome(float("nan"), [], 0, False, ("429", "429", "429")),
        Outcome(float("nan"), [], 0, False, ("400",)),
    ]
    longs = [Outcome(9.0, [9.0], 16), Outcome(float("nan"), [], 0, False, ("429",))]
    figures = summarize(results, 2.0, Figures(4, 0), longs)
    assert figures["out_tok_s"] == 2.5 and figures["served"] == 2  # (3 + 2) tokens / 2 s
    assert figures["ttft_p50_ms"] == pytest.approx(20.0) and figures["itl_p50_ms"] == pytest.approx(40.0)
    assert figures["rejected"] == 4 and figures["errors_by_status"] == {"400": 1, "429": 4}
    assert (figures["long_prompts"], figures["long_prompts_served"], figures["long_errors_by_status"]) == (
        2,
        1,
        {"429": 1},
    )
    nothing = summarize([Outcome(float("nan"), [], 0, False, ("429",))], 1.0, Figures(0, None))
    assert nothing["ttft_p50_ms"] is None and nothing["itl_p99_ms"] is None and nothing["out_tok_s"] == 0.0


# the HTTP side against the real app over a runner that refuses the attempts a plan names


class RefusingRunner(FakeRunner):
    """A FakeRunner whose submit raises, for a request of seed s, plan[s]'s exceptions one per attempt
    (Overloaded: the server's 429 with Retry-After; ValueError: a 400), then admits it."""

    def __init__(self, script: list[int], plan: dict[int, list[type[Exception]]], **kw):
        super().__init__(script, **kw)
        self.plan = {seed: list(errors) for seed, errors in plan.items()}
        self.refused: list[int] = []  # the seed of each refused attempt

    def submit(self, request, loop=None):
        with self.changed:
            planned = self.plan.get(request.sampling.seed)
            if planned:
                self.refused.append(request.sampling.seed)
                self.changed.notify_all()
                raise planned.pop(0)("refused by the test's plan")
        return super().submit(request, loop)


PLAN = {1: [Overloaded], 3: [Overloaded] * 3, 4: [ValueError]}  # served after a retry; given up; a 400


@pytest.fixture(scope="module")
def tokenizer(smollm2_home):
    return ModelStore(smollm2_home).tokenizer("smollm2-135m-instruct")  # its weights are not needed


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(runner) -> str:
        servers.append(LiveServer(create_app(runner, tokenizer, "fake", 512)))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def jobs_of(tokenizer, n: int) -> list[Job]:
    ids = tokenizer.encode(" and so on, the end")
    return [Job(ids, ids, 3 + i) for i in range(n)]  # request i: a reply of 3 + i tokens


def test_each_attempt_sees_the_servers_status_and_retry_after(serve, tokenizer):
    url = serve(RefusingRunner(tokenizer.encode(" and so on,"), PLAN))
    jobs = jobs_of(tokenizer, 5)
    with httpx.Client(timeout=60) as client:
        outcomes = {}
        for seed in (0, 1, 3, 4):
            waits = Waits()
            body = completion_body("fake", jobs[seed], seed)
            outcomes[seed] = (with_retries(lambda body=body: attempt(client, url, body), waits, retries=2), waits)
    for seed in (0, 1):  # served: every token of its reply, each a gap after the first
        outcome, _ = outcomes[seed]
        assert outcome.served and outcome.tokens == 3 + seed and len(outcome.itl) == 2 + seed and outcome.ttft > 0
    assert outcomes[0][0].refusals == () and outcomes[1][0].refusals == ("429",)
    assert outcomes[1][1] == [1.0]  # hkserve's Retry-After: 1
    assert outcomes[3][0].refusals == ("429",) * 3 and not outcomes[3][0].served and outcomes[3][1] == [1.0, 1.0]
    assert outcomes[4][0].refusals == ("400",) and outcomes[4][1] == []


def test_an_http_phase_with_refused_requests_completes_and_counts_them(serve, tokenizer):
    runner = RefusingRunner(tokenizer.encode(" and so on,"), PLAN)
    url = serve(runner)
    figures = http_phase(url, "fake", Load(3, 6, retries=2), jobs_of(tokenizer, 6))
    assert figures["served"] == 4 and figures["rejected"] == 4 and figures["errors_by_status"] == {"400": 1, "429": 4}
    assert sorted(r.sampling.seed for r in runner.submitted) == [0, 1, 2, 5]  # the served, each admitted once
    assert figures["out_tok_s"] > 0 and figures["itl_p99_ms"] >= figures["itl_p50_ms"] > 0


def test_long_prompts_refused_with_429_are_counted_and_the_phase_completes(serve, tokenizer):
    plan = {LONG_SEED + k: [Overloaded] for k in range(1, 10_000)}  # every long prompt refused once
    runner = RefusingRunner(tokenizer.encode(" and so on,"), plan, held=True)
    url = serve(runner)
    long = LongPrompts(tokenizer.encode(" and so on, the end"), 512)
    phase: list[dict] = []
    load = Load(2, 2, every=0.01, retries=0)  # no retry: one refusal per long prompt
    thread = threading.Thread(target=lambda: phase.append(http_phase(url, "fake", load, jobs_of(tokenizer, 2), long)))
    thread.start()
    try:  # the measured clients held until a long prompt has been refused
        assert runner.wait_until(lambda: len(runner.refused) >= 1)
    finally:
        runner.go.set()
        thread.join(120)
    (figures,) = phase
    assert figures["long_prompts"] >= 1 and figures["long_prompts_served"] == 0
    assert figures["long_errors_by_status"] == {"429": figures["long_prompts"]}
    assert figures["served"] == 2 and figures["errors_by_status"] == {}  # the measured clients' own


# a connection that gives no answer, or breaks off inside a stream (a raw socket server, no sleeps)


class RawServer:
    """Answers each connection's request with `reply` bytes, then closes it: a server that drops a
    keep-alive connection under a request (b""), or one whose stream breaks off after its head."""

    def __init__(self, reply: bytes):
        self.reply, self.sock = reply, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, body = data.split(b"\r\n\r\n", 1)
                length = int(
                    next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1]
                )
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(self.reply)


BROKEN_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"2a\r\n" + b'data: {"choices": [{"text": "a"}]}\n\n'.ljust(42) + b"\r\n"
)  # one chunk of 42 bytes, then the connection closes without the last chunk


@pytest.mark.parametrize(
    ("reply", "refusals", "waits"),
    [(b"", ("connection_error",) * 3, [0.5, 1.0]), (BROKEN_STREAM, ("stream_error",), [])],
)
def test_no_answer_is_retried_with_backoff_and_a_broken_stream_is_not(reply, refusals, waits):
    server = RawServer(reply)
    body = completion_body("fake", Job([1, 2], [1, 2], 4), 0)
    with httpx.Client(timeout=60) as client:
        recorded = Waits()
        outcome = with_retries(lambda: attempt(client, server.url, body), recorded, retries=2)
    server.sock.close()
    assert outcome.refusals == refusals and not outcome.served and recorded == waits


# the in-process runner's side refuses as the server would


def test_the_runner_side_counts_the_refusals_the_server_would_answer(tokenizer):
    runner = RefusingRunner(tokenizer.encode(" and so on,"), {0: [Overloaded], 1: [ValueError]})
    jobs = jobs_of(tokenizer, 4)
    with pytest.raises(Refused) as full:
        runner_attempt(runner, jobs[0], 0)
    assert (full.value.status, full.value.retry_after) == ("429", 1.0)  # the server's 429 and Retry-After
    with pytest.raises(Refused) as bad:
        runner_attempt(runner, jobs[1], 1)
    assert (bad.value.status, bad.value.retry_after) == ("400", None)
    runner = RefusingRunner(tokenizer.encode(" and so on,"), {1: [Overloaded], 2: [ValueError]})
    figures = runner_phase(runner, Load(2, 4, retries=1), jobs)
    assert figures["served"] == 3 and figures["rejected"] == 1 and figures["errors_by_status"] == {"400": 1, "429": 1}
    assert figures["out_tok_s"] > 0 and figures["preemptions"] is None
