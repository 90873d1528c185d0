"""`hkserve bench serve`: start the real server, drive it over HTTP with concurrent streaming clients,
report TTFT, inter-token latency and output tokens/s per concurrency, with the most requests running
at once and the preemptions the server counted (bench/watch.py); beside them, the same workload
submitted to an in-process InferenceRunner (bench/serve_runner.py), so the HTTP layer's cost is a
same-run ratio. Each figure is the median of --repeats runs, the sides alternating order; with
--compare-prefill-rows, also a runner prefilling one prompt per call (batched prefill's effect).

Every request generates exactly its reply length (`ignore_eos`): --max-tokens with --lengths fixed,
so figures compare with the engine benchmark's fixed-length decode, or drawn from a chat-like
distribution with --lengths chat (bench/workload.py). With --long-prompt-every S, a long prompt
arrives every S seconds beside the measured clients (bench/arrivals.py), its tokens not counted.

An overloaded server's refusals are counted, not fatal: a 429 is retried as a real client would
(bench/refusals.py) and the served requests measured (bench/phase.py). Each run's row goes to stderr
as it ends, and --duration-s bounds a run's time, so a long run shows what it had when cut short.

The clients are threads with their own HTTP connections, in this process; the server is a separate
process, as in deployment, so client overhead does not steal the engine's interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time

from hkserve.bench.phase import Load, medians
from hkserve.bench.refusals import RETRIES
from hkserve.bench.serve_http import http_phase
from hkserve.bench.workload import PROMPTS, Job, LongPrompts, chat_jobs, distribution, fixed_jobs
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUTS
from hkserve.model.config import KV_DTYPES


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count of 0 or more, got {text!r}")
    return value


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", default="1,8,16", help="comma list of simultaneous streaming clients")
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per run of a side at each concurrency (default: 3 x concurrency, >= 4; with --duration-s: "
        "no count)",
    )
    p.add_argument(
        "--duration-s",
        type=_seconds,
        default=None,
        metavar="S",
        help="bound each run: no request (or retry) begins S seconds after it started, those under way finish; "
        "with --requests, whichever comes first. A run at c clients takes ~S s plus its longest request",
    )
    p.add_argument(
        "--retries",
        type=_count,
        default=RETRIES,
        metavar="N",
        help="a request answered 429 (or not answered: connection_error) is sent again up to N times, after the "
        "answer's Retry-After seconds (hkserve sends 1) or else 0.5 x 2^n s, as the OpenAI Python SDK does; other "
        "non-2xx answers and failed streams are not retried. Every refusal is counted by status (rejected, "
        "errors_by_status) and the served requests measured",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="--lengths fixed: every reply's length")
    p.add_argument(
        "--lengths",
        choices=("fixed", "chat"),
        default="fixed",
        help="fixed: four short text prompts, --max-tokens replies; chat: prompt and reply lengths from a fixed-seed "
        "chat-like lognormal distribution with long tails, clipped to --max-len (docs/benchmarks.md)",
    )
    p.add_argument(
        "--long-prompt-every",
        type=_seconds,
        default=None,
        metavar="S",
        help="a 4096-token prompt (at most --max-len - 16) arrives every S seconds beside the measured clients, "
        "its own tokens not counted",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=16,
        help="the server's slots; static layout: raised to the largest --concurrency (paged: as given)",
    )
    p.add_argument("--max-len", type=int, default=2048, help="context length (fewer programs to compile when small)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per concurrency; medians are reported")
    p.add_argument("--prefill-rows", type=int, default=4, help="the server's and runner's batched prefill rows")
    p.add_argument(
        "--compare-prefill-rows",
        action="store_true",
        help="also measure an in-process runner with --prefill-rows 0 (one prompt per prefill call)",
    )
    p.add_argument("--kv-layout", choices=LAYOUTS, default=DEFAULT_LAYOUT, help="the server's and runner's KV layout")
    p.add_argument("--kv-cache-mb", type=float, default=None, help="paged: the server's and runner's KV pool (MiB)")
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="paged: tokens per KV block")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto", help="the server's and runner's KV dtype")
    p.add_argument(
        "--max-step-tokens", type=int, default=None, help="the server's and runner's --max-step-tokens (see serve)"
    )
    p.add_argument("--json", action="store_true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> tuple[int | None, dict]:
    """/health's status code and body, or (None, {}) while nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    except OSError:
        return None, {}
    finally:
        conn.close()


def _compiled(port: int) -> bool:
    """Whether the server has compiled every program (/health: none pending after ready)."""
    status, body = _health(port)
    return status == 200 and body.get("programs", {}).get("pending", 0) == 0


@contextlib.contextmanager
def serving(
    model: str,
    slots: int,
    max_queue: int,
    prefill_rows: int = 4,
    max_len: int = 2048,
    ready_within=1800,
    extra: tuple[str, ...] = (),
):
    """`hkserve serve` in a separate process on a free port, once /health says ready and no compile is
    pending (its background compiles would otherwise land inside the measured phases): yields (url,
    process). `extra`: more of serve's flags."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", model, "--port", str(port)]
    cmd += ["--slots", str(slots), "--max-queue", str(max_queue), "--prefill-rows", str(prefill_rows)]
    cmd += ["--max-len", str(max_len), *extra]
    print(f"starting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        deadline = time.time() + ready_within
        while not _compiled(port):
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
            if time.time() > deadline:
                raise RuntimeError(f"the server was not ready within {ready_within:.0f} s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.terminate()
        server.wait(60)


def _ms(value: float | None, width: int) -> str:
    return f"{value:{width}.1f} ms" if value is not None else f"{'-':>{width}} ms"


def _line(name: str, c: int, r: dict) -> str:
    """A side's figures at one concurrency as a table row."""
    return (
        f"{name:<16} concurrency {c:>3}: {r['out_tok_s']:8.1f} out tok/s  TTFT p50 {_ms(r['ttft_p50_ms'], 7)} "
        f"p99 {_ms(r['ttft_p99_ms'], 7)}  ITL p50 {_ms(r['itl_p50_ms'], 6)} p99 {_ms(r['itl_p99_ms'], 6)}  "
        f"served {r['served']:.0f} rejected {r['rejected']:.0f}"
    )


def _progress(name: str, c: int, run: int, runs: int, figures: dict) -> None:
    """One phase's row and its figures on stderr as soon as it ends, so a run cut short shows what it had."""
    print(f"{_line(name, c, figures)}  (run {run}/{runs})", file=sys.stderr, flush=True)
    print(f"  figures: {json.dumps(figures)}", file=sys.stderr, flush=True)


def server_slots(layout: str, slots: int, levels: list[int]) -> int:
    """The server's slots. Static: raised to the most clients, so none queues (as before); paged: as
    given, the most rows decoded together, so more clients than slots measure admission by free blocks."""
    return slots if layout == "paged" else max(slots, max(levels))


def server_flags(kv, lengths: str) -> tuple[str, ...]:
    """serve's flags for the KV memory (`kv`: serve_runner.KVOptions) and, with chat lengths, the prefix
    cache off: those prompts share no prefix, but each repeat and level sends them again, which the
    server's cache (on by default) would answer from memory while the in-process runner (off) prefills."""
    return kv.flags() + (("--prefix-cache", "off") if lengths == "chat" else ())


def _workload(args, levels: list[int]) -> tuple[list[Job], LongPrompts | None]:
    """(the measured requests' jobs, the long prompts or None) of --lengths and --long-prompt-every."""
    from hkserve.bench.serve_runner import prompt_ids

    ids = prompt_ids(args.model, PROMPTS)
    vocabulary = sorted({t for prompt in ids for t in prompt})
    if args.lengths == "chat":
        jobs = chat_jobs(max(args.requests or max(4, 3 * c) for c in levels), vocabulary, args.max_len)
    else:
        jobs = fixed_jobs(ids, args.max_tokens)
    return jobs, LongPrompts(vocabulary, args.max_len) if args.long_prompt_every else None


def _sides(args, url: str, runners: dict, jobs: list[Job], long: LongPrompts | None) -> dict:
    """side name → phase(Load) → its figures: "http" and each in-process runner."""
    from hkserve.bench.serve_runner import runner_phase

    sides = {"http": lambda load: http_phase(url, args.model, load, jobs, long)}
    return sides | {
        name: (lambda load, r=runner: runner_phase(r, load, jobs, long)) for name, runner in runners.items()
    }


def _requests(args, c: int) -> int | None:
    """A phase's requests at concurrency c: --requests, else 3 x c (at least 4), else none with --duration-s."""
    if args.requests:
        return args.requests
    return None if args.duration_s is not None else max(4, 3 * c)


def _measure(args, levels: list[int], sides: dict) -> dict:
    """Per concurrency, each side's medians over --repeats runs, the sides' order alternating: the HTTP
    side's at report[str(c)], a runner's at report[name][str(c)]. Each run's row goes to stderr as it ends."""
    report: dict = {name: {} for name in sides if name != "http"}
    for c in levels:
        load = Load(c, _requests(args, c), args.duration_s, args.long_prompt_every, args.retries)
        runs: dict[str, list] = {name: [] for name in sides}
        for repeat in range(args.repeats):
            for name in list(sides)[:: -1 if repeat % 2 else 1]:
                runs[name].append(sides[name](load))
                _progress(name, c, repeat + 1, args.repeats, runs[name][-1])
        for name, figures in runs.items():
            (report if name == "http" else report[name])[str(c)] = medians(figures)
            print(_line(name, c, medians(figures)), flush=True)
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(args, levels: list[int], report: dict) -> dict:
    """The same run's ratios; None where a side had no figure (it served nothing)."""
    ratios = {
        f"http_over_runner_out_tok_s_{c}": _ratio(report[str(c)]["out_tok_s"], report["runner"][str(c)]["out_tok_s"])
        for c in levels
    }
    if args.compare_prefill_rows:
        for c in levels:
            before, after = report["runner_prefill_rows_0"][str(c)], report["runner"][str(c)]
            ratios[f"ttft_p50_rows_{args.prefill_rows}_over_rows_0_{c}"] = _ratio(
                after["ttft_p50_ms"], before["ttft_p50_ms"]
            )
    return ratios


def _settings(args, slots: int, long: LongPrompts | None) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "slots": slots,
        "prefill_rows": args.prefill_rows,
        "max_len": args.max_len,
        "kv_layout": args.kv_layout,
        "kv_cache_mb": args.kv_cache_mb,
        "kv_block_size": args.kv_block_size,
        "kv_dtype": args.kv_dtype,
        "lengths": args.lengths,
        "chat_distribution": distribution() if args.lengths == "chat" else None,
        "long_prompt_every_s": args.long_prompt_every,
        "long_prompt_tokens": long.length if long else None,
        "duration_s": args.duration_s,
        "retries": args.retries,
        "cpus": os.cpu_count(),
    }


def run(args) -> int:
    from hkserve.bench.serve_runner import KVOptions, runner_clients, start_runner

    if args.kv_cache_mb is not None and args.kv_layout != "paged":
        print("--kv-cache-mb sizes the paged pool: use it with --kv-layout paged", file=sys.stderr)
        return 2
    levels = [int(x) for x in args.concurrency.split(",")]
    slots, max_queue = server_slots(args.kv_layout, args.slots, levels), 4 * max(levels) + 8
    jobs, long = _workload(args, levels)
    kv = KVOptions(args.kv_layout, args.kv_cache_mb, args.kv_block_size, args.kv_dtype, args.max_step_tokens)
    extra = server_flags(kv, args.lengths)
    with serving(args.model, slots, max_queue, args.prefill_rows, args.max_len, extra=extra) as (url, _):
        http_phase(url, args.model, Load(1, 2), [*jobs[:1], long()] if long else jobs)  # warm the HTTP path
        print("starting the in-process runner(s) ...", file=sys.stderr, flush=True)
        runners = {"runner": start_runner(args.model, slots, max_queue, args.prefill_rows, args.max_len, kv)}
        if args.compare_prefill_rows:
            runners["runner_prefill_rows_0"] = start_runner(args.model, slots, max_queue, 0, args.max_len, kv)
        warm = [jobs[i % len(jobs)] for i in range(max(levels))] + ([long()] if long else [])
        try:
            for runner in runners.values():  # untimed: compiles what the workload uses
                runner_clients(runner, warm, max(levels), len(warm))
            report = _measure(args, levels, _sides(args, url, runners, jobs, long))
        finally:
            for runner in runners.values():
                runner.stop()
    report["ratios"] = _ratios(args, levels, report)
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.3f}" if value is not None else f"{key}: -")
    report["settings"] = _settings(args, slots, long)
    if args.json:
        print(json.dumps(report))
    return 0
