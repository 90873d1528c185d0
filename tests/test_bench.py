"""`bench engine` on a tiny checkpoint: it runs end to end and its JSON line is complete. `bench serve`'s
parts: its chat workload, the long prompts' schedule, what it reads from /metrics, and its HTTP phase's
figures against a live server over a scripted runner (the whole command: docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
from helpers import REPO, hkserve, require_fixtures
from http_helpers import FakeRunner, LiveServer

from hkserve.api.app import create_app
from hkserve.bench.arrivals import arrivals
from hkserve.bench.phase import Load, measure, medians
from hkserve.bench.refusals import Outcome
from hkserve.bench.serve import server_flags, server_slots
from hkserve.bench.serve_http import http_phase
from hkserve.bench.serve_runner import KVOptions
from hkserve.bench.watch import Figures, Sample, parse, watch
from hkserve.bench.workload import CHAT_SEED, LongPrompts, chat_jobs, chat_lengths
from hkserve.checkpoint.store import ModelStore
from hkserve.cli.main import build_parser
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE


def test_bench_engine_json_on_tiny_model(tmp_path):
    hkserve("convert", str(require_fixtures() / "hf" / "tiny-llama-tied"), "--name", "tiny", "--quiet", home=tmp_path)
    env = {**os.environ, "HKSERVE_HOME": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hkserve.cli.main",
            "bench",
            "engine",
            "--model",
            "tiny",
            "--slots",
            "1,2",
            "--steps",
            "3",
            "--hf-batches",
            "1",
            "--repeats",
            "1",
            "--bandwidth-mb",
            "256",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert set(report["hkserve"]) == {"1", "2"} and all(v > 0 for v in report["hkserve"].values())
    limits = report["limits"]
    for key in ("bandwidth_gb_s", "bandwidth_tok_s", "matmul_gflop_s", "compute_tok_s"):
        assert limits[key] > 0, key
    ratios = report["ratios"]
    assert ratios["hkserve_1_over_bandwidth_limit"] > 0 and ratios["hkserve_2_over_compute_limit"] > 0
    peer = report["hf_transformers"]  # None where torch/transformers are not installed (CI's '.[test]')
    if peer is None:
        assert ratios["hkserve_1_over_hf_1"] is None
    else:
        assert set(peer) == {"1"} and peer["1"] > 0
        assert ratios["hkserve_1_over_hf_1"] > 0
    assert "hkserve" in result.stdout.splitlines()[0]  # the human table comes first


@pytest.mark.slow  # int8 variant, kernel build in a fresh home, 2 x 2 engines: minutes on a busy machine
@pytest.mark.timeout(900)
def test_bench_engine_by_kernels_on_tiny_model(tmp_path):
    hkserve("convert", str(require_fixtures() / "hf" / "tiny-llama-tied"), "--name", "tiny", "--quiet", home=tmp_path)
    args = ["--model", "tiny", "--slots", "1,2", "--steps", "3", "--hf-batches", "1", "--repeats", "2"]
    args += ["--bandwidth-mb", "64", "--weights", "int8", "--kernels", "auto,xla", "--json"]
    result = hkserve("bench", "engine", *args, home=tmp_path, timeout=850)
    by_kernels = json.loads(result.stdout.strip().splitlines()[-1])["by_kernels"]
    for side in ("int8/auto", "int8/xla"):  # the kernels and XLA's dots, alternated
        assert set(by_kernels[side]) == {"1", "2"}, side
        for figure in by_kernels[side].values():
            assert figure["tok_s"] > 0 and figure["spread"] >= 1 and len(figure["runs"]) == 2
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert "not installed" in by_kernels["llama.cpp"]["skipped"]
    else:
        assert "--llama-gguf" in by_kernels["llama.cpp"]["skipped"]


# bench serve's workload (bench/workload.py): fixed-seed chat lengths with long tails, clipped to fit


def test_chat_lengths_are_fixed_by_the_seed():
    first = chat_lengths(6, 4096)
    assert first == [(192, 37), (2624, 147), (381, 85), (212, 131), (243, 61), (370, 148)]  # pinned: comparable runs
    assert chat_lengths(3, 4096) == first[:3]  # request i's lengths do not depend on how many are drawn
    assert chat_lengths(6, 4096, seed=CHAT_SEED + 1) != first
    jobs = chat_jobs(6, [11, 12, 13], 4096)
    assert jobs == chat_jobs(6, [11, 12, 13], 4096)
    assert [(len(j.ids), j.max_tokens) for j in jobs] == first
    assert all(j.prompt == j.ids and set(j.ids) <= {11, 12, 13} for j in jobs)  # token ids, of the vocabulary
    assert len({tuple(j.ids[:8]) for j in jobs}) == 6  # no shared prefix for the prefix cache to reuse


def test_chat_lengths_have_long_tails():
    lengths = np.array(chat_lengths(2000, 1 << 20))  # [2000, 2]: no clipping at this context
    median, p99 = np.percentile(lengths, 50, axis=0), np.percentile(lengths, 99, axis=0)
    assert 180 <= median[0] <= 220 and 90 <= median[1] <= 110  # PROMPT_MEDIAN, REPLY_MEDIAN
    assert p99[0] > 7 * median[0] and p99[1] > 4.5 * median[1]  # lognormal tails: sigma 1.0 and 0.8
    assert lengths[:, 0].max() > 2048 and lengths[:, 1].max() > 1024


def test_chat_lengths_are_clipped_to_the_context():
    lengths = np.array(chat_lengths(2000, 256))
    prompts, replies = lengths[:, 0], lengths[:, 1]
    assert prompts.min() >= 1 and replies.min() >= 1 and replies.max() == 128  # a reply keeps half the context
    assert (prompts + replies).max() == 256  # every request fits, the longest exactly
    assert chat_lengths(5, 2) == [(1, 1)] * 5
    with pytest.raises(ValueError, match="--max-len"):
        chat_lengths(1, 1)
    long = LongPrompts([5, 6, 7], 1 << 16)
    first, second = long(), long()
    assert len(first.ids) == len(second.ids) == long.length == 4096 and first.max_tokens == 16
    assert first.ids[:32] != second.ids[:32]  # each arrival a new prompt: no prefix-cache hit, a real prefill
    assert LongPrompts([5], 1024)().ids == [5] * (1024 - 16)  # the ~4k prompt, clipped to what the context allows
    with pytest.raises(ValueError, match="--max-len"):
        LongPrompts([5], 16)


def test_bench_serve_flags_reach_the_server_it_starts():
    bench = build_parser().parse_args(
        ["bench", "serve", "--kv-layout", "paged", "--kv-cache-mb", "256", "--kv-dtype", "bf16"]
    )
    kv = KVOptions(bench.kv_layout, bench.kv_cache_mb, bench.kv_block_size, bench.kv_dtype)
    serve = build_parser().parse_args(["serve", *server_flags(kv, bench.lengths)])
    assert (serve.kv_layout, serve.kv_cache_mb, serve.kv_block_size) == ("paged", 256.0, DEFAULT_BLOCK_SIZE)
    assert serve.kv_dtype == "bf16"
    assert serve.prefix_cache is None  # fixed lengths: the server's default, as before
    serve = build_parser().parse_args(["serve", *server_flags(kv, "chat")])
    assert serve.prefix_cache == "off"  # chat: like the in-process runner, no repeat served from the cache
    serve = build_parser().parse_args(["serve", *KVOptions("static", None, 16).flags()])
    assert (serve.kv_layout, serve.kv_cache_mb, serve.kv_block_size, serve.kv_dtype) == ("static", None, 16, "auto")
    assert serve.max_step_tokens is None  # the runner's default
    bench = build_parser().parse_args(["bench", "serve", "--max-step-tokens", "96", "--long-prompt-every", "3"])
    kv = KVOptions(bench.kv_layout, bench.kv_cache_mb, bench.kv_block_size, bench.kv_dtype, bench.max_step_tokens)
    assert build_parser().parse_args(["serve", *server_flags(kv, bench.lengths)]).max_step_tokens == 96
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-step-tokens", "0"])
    assert server_slots("static", 16, [16, 64]) == 64  # as before: no client queues
    assert server_slots("paged", 16, [16, 64]) == 16  # the 64 clients on 16 rows of one pool
    for wrong in (["--long-prompt-every", "0"], ["--long-prompt-every", "x"], ["--lengths", "long"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", *wrong])


# --long-prompt-every's schedule (bench/arrivals.py), on an injected clock


class FakeTime:
    """A clock and a stop event whose wait(t) moves the clock by t: stopped once it reaches `end`."""

    def __init__(self, end: float, send_takes: float = 0.0):
        self.now, self.end, self.send_takes, self.sent = 100.0, end, send_takes, []

    def clock(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.now += timeout
        return self.now >= 100.0 + self.end

    def send(self, k: int) -> None:
        self.sent.append((k, self.now - 100.0))
        self.now += self.send_takes


def test_long_prompts_arrive_every_s_seconds_from_the_start():
    fake = FakeTime(end=10.0)
    assert arrivals(3.0, fake.send, fake, fake.clock) == 3
    assert fake.sent == [(1, 3.0), (2, 6.0), (3, 9.0)]


def test_a_late_long_prompt_does_not_shift_the_schedule():
    fake = FakeTime(end=10.0, send_takes=4.0)  # each send overruns the next arrival
    assert arrivals(3.0, fake.send, fake, fake.clock) == 2
    assert fake.sent == [(1, 3.0), (2, 7.0)]  # the second at once when late; the third due at 9, stopped at 11


def test_long_prompts_are_counted_apart_from_the_measured_clients():
    sent = threading.Event()

    def clients(stop):  # the measured phase lasts until a long prompt has been sent
        assert sent.wait(60)
        return [Outcome(0.01, [0.02, 0.04], 3)], 2.0

    def long_one(k, stop):
        sent.set()
        return Outcome(9.0, [9.0], 1000)

    figures = measure(clients, lambda: Sample(1, None), 0.001, long_one)
    assert figures["long_prompts"] >= 1
    assert figures["out_tok_s"] == 1.5 and figures["ttft_p50_ms"] == pytest.approx(10.0)  # the clients' alone
    assert figures["itl_p99_ms"] <= 40.0
    assert (
        measure(lambda stop: ([Outcome(0.01, [], 1)], 1.0), lambda: Sample(1, None), None, long_one)["long_prompts"]
        == 0
    )


# what the server counted over a phase (bench/watch.py)

EXPOSITION = """# TYPE hkserve_requests_running gauge
hkserve_requests_running 3.0
# TYPE hkserve_preemptions counter
hkserve_preemptions_total {preemptions}
hkserve_preemptions_created 1.7e+09
"""


def test_metrics_text_gives_running_and_preemptions_only_when_exported():
    assert parse(EXPOSITION.format(preemptions="0.0")) == Sample(3, 0.0)
    assert parse(EXPOSITION.format(preemptions="7.0")) == Sample(3, 7.0)
    no_counter = "\n".join(line for line in EXPOSITION.splitlines() if "preemptions" not in line) + "\n"
    assert parse(no_counter) == Sample(3, None)  # absent: None, never a made-up 0
    by_reason = EXPOSITION.format(preemptions="2.0").replace("_total 2.0", '_total{reason="blocks"} 2.0')
    by_reason += 'hkserve_preemptions_total{reason="other"} 3.0\n'
    assert parse(by_reason) == Sample(3, 5.0)  # a labelled counter: all its series
    with pytest.raises(ValueError, match="hkserve_requests_running"):
        parse("# TYPE other gauge\nother 1.0\n")


def test_watch_reports_the_peak_and_the_counter_growth_over_the_phase():
    def scripted(samples):
        reads, stops = iter(samples), iter([False] * (len(samples) - 2) + [True])
        return lambda: next(reads), lambda interval: next(stops)

    read, stopped = scripted([Sample(0, 5.0), Sample(4, 5.0), Sample(7, 6.0), Sample(2, 8.0)])
    assert watch(read, stopped) == Figures(peak_running=7, preemptions=3)  # the largest sample, not the last
    read, stopped = scripted([Sample(0, 0.0), Sample(1, 0.0), Sample(1, 0.0)])
    assert watch(read, stopped) == Figures(1, 0)  # exported and 0
    read, stopped = scripted([Sample(2, None), Sample(5, None), Sample(0, None)])
    assert watch(read, stopped) == Figures(5, None)


# bench serve's HTTP phase against a live server whose runner replays a script


class ScrapedRunner(FakeRunner):
    """A FakeRunner that records the running count each /metrics scrape read."""

    def __init__(self, script):
        super().__init__(script, held=True)
        self.scraped: list[int] = []

    def stats(self):
        stats = super().stats()
        with self.changed:
            self.scraped.append(stats.running)
            self.changed.notify_all()
        return stats


SERVE_KEYS = {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "out_tok_s"}  # before issue 34
SERVE_KEYS |= {"out_tok_s_spread", "ttft_p50_ms_spread", "peak_running", "preemptions", "long_prompts"}
SERVE_KEYS |= {"served", "rejected", "errors_by_status", "long_prompts_served", "long_errors_by_status"}  # refusals


def test_http_phase_reports_every_key_with_the_peak_read_from_metrics(smollm2_home):
    tokenizer = ModelStore(smollm2_home).tokenizer("smollm2-135m-instruct")  # its weights are not needed
    runner = ScrapedRunner(tokenizer.encode(" and so on," * 4))
    server = LiveServer(create_app(runner, tokenizer, "fake", 512))
    jobs = chat_jobs(5, tokenizer.encode(" and so on, the end"), 256)
    phase: list[dict] = []
    try:
        thread = threading.Thread(target=lambda: phase.append(http_phase(server.url, "fake", Load(3, 5), jobs)))
        thread.start()
        # every client's request held by the runner, and a scrape that read them all: then let them go
        assert runner.wait_until(lambda: 3 in runner.scraped)
        runner.go.set()
        thread.join(120)
        exported = "hkserve_preemptions_total" in httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        runner.go.set()
        server.stop()
    report = medians(phase)
    assert set(report) == SERVE_KEYS
    assert report["peak_running"] == 3 and report["long_prompts"] == 0
    assert report["served"] == 5 and report["rejected"] == 0 and report["errors_by_status"] == {}
    assert report["preemptions"] == (0 if exported else None)  # read when the server has the counter
    sent = sorted((r.prompt_ids, r.max_tokens, r.sampling.seed) for r in runner.submitted)
    assert sent == sorted((j.ids, j.max_tokens, i) for i, j in enumerate(jobs))  # request i: job i, seed i
    assert report["out_tok_s"] > 0 and report["itl_p99_ms"] >= report["itl_p50_ms"] > 0
    json.dumps(report, allow_nan=False)
