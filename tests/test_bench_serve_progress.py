"""`bench serve` shows what it measured as it goes and can be sized: each run's row reaches stderr as soon
as that run ends (a run cut short keeps what it printed), and --duration-s bounds a run's time (no request
begins after it). The figures keep their meaning: the medians of the runs, the counts by status summed."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from hkserve.bench.clients import run_clients
from hkserve.bench.phase import measure, medians, summarize
from hkserve.bench.refusals import Outcome
from hkserve.bench.serve import _line, _measure, _ratios, _requests
from hkserve.bench.watch import Figures, Sample
from hkserve.cli.main import build_parser


def args_of(**kw) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *[x for k, v in kw.items() for x in (f"--{k}", str(v))]])


def test_each_runs_row_reaches_stderr_as_soon_as_it_ends(capsys):
    seen: list[tuple[str, int, str]] = []  # (side, concurrency, what stderr got since the last phase began)
    number = iter(range(1, 100))

    def side(name):
        def phase(load):
            seen.append((name, load.concurrency, capsys.readouterr().err))
            return summarize([Outcome(0.01, [0.02], 2)], 2 / next(number), Figures(1, None))  # out_tok_s 1, 2, ...

        return phase

    report = _measure(args_of(repeats=2, concurrency="1,4"), [1, 4], {"http": side("http"), "runner": side("runner")})
    order = [
        ("http", 1),
        ("runner", 1),
        ("runner", 1),
        ("http", 1),
        ("http", 4),
        ("runner", 4),
        ("runner", 4),
        ("http", 4),
    ]
    assert [(name, c) for name, c, _ in seen] == order  # the sides alternate their order each repeat
    rows = [err for _, _, err in seen[1:]] + [capsys.readouterr().err]
    assert seen[0][2] == ""
    for k, ((name, c), err) in enumerate(zip(order, rows, strict=True)):  # phase k's row, before phase k + 1
        row, figures = err.splitlines()
        run = 1 + (k % 4) // 2
        assert row.startswith(f"{name:<16} concurrency {c:>3}: {k + 1:8.1f} out tok/s") and row.endswith(
            f"(run {run}/2)"
        )
        assert json.loads(figures.removeprefix("  figures: ")) == summarize(
            [Outcome(0.01, [0.02], 2)], 2 / (k + 1), Figures(1, None)
        )
    assert report["1"]["out_tok_s"] == 2.5 and report["runner"]["4"]["out_tok_s"] == 6.5  # medians of (1, 4), (6, 7)


def test_a_row_with_nothing_served_prints_and_counts_by_status_sum_over_runs():
    refused = summarize([Outcome(float("nan"), [], 0, False, ("429",) * 3)], 1.0, Figures(0, None))
    served = summarize(
        [Outcome(0.01, [0.02], 2, True, ("429",)), Outcome(0.02, [], 1, True, ("503",))], 1.0, Figures(2, 0)
    )
    row = medians([refused, served, served])
    assert row["errors_by_status"] == {"429": 5, "503": 2} and row["rejected"] == 1.0  # summed; the median
    assert row["ttft_p50_ms"] is None and row["ttft_p50_ms_spread"] == [15.0, 15.0] and row["out_tok_s"] == 3.0
    assert "TTFT p50       - ms" in _line("http", 16, medians([refused])) and "rejected 3" in _line("http", 16, refused)
    assert medians([refused])["out_tok_s_spread"] == [0.0, 0.0] and medians([refused])["ttft_p50_ms_spread"] is None
    report = {"1": medians([served]), "runner": {"1": medians([refused])}}  # the runner side served nothing
    assert _ratios(args_of(), [1], report) == {"http_over_runner_out_tok_s_1": None}  # no ratio, no crash
    report["runner"]["1"] = medians([served, served])
    assert _ratios(args_of(), [1], report) == {"http_over_runner_out_tok_s_1": 1.0}


def test_duration_bounds_a_phase_and_requests_default_to_none_with_it():
    assert _requests(args_of(), 16) == 48 and _requests(args_of(), 1) == 4  # 3 x c, at least 4, as before
    assert _requests(args_of(**{"duration-s": 30}), 16) is None  # bounded by time alone
    assert _requests(args_of(**{"duration-s": 30, "requests": 10}), 16) == 10  # whichever comes first
    parsed = args_of(**{"duration-s": 2.5, "retries": 0})
    assert (parsed.duration_s, parsed.retries) == (2.5, 0) and args_of().retries == 2
    for wrong in (["--duration-s", "0"], ["--retries", "-1"], ["--retries", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "serve", *wrong])

    def clients(stop):  # the phase lasts until --duration-s's timer stops it
        assert stop.wait(60)
        return [Outcome(0.01, [], 1)], 1.0

    figures = measure(clients, lambda: Sample(0, None), None, lambda k, stop: None, duration=0.01)
    assert figures["served"] == 1 and figures["long_prompts"] == 0


def test_no_request_begins_once_the_phase_is_stopped():
    stop = threading.Event()

    def one(i):
        if i == 2:
            stop.set()
        return i

    assert run_clients(1, None, one, stop)[0] == [0, 1, 2]  # no count: the stop ends it
    assert sorted(run_clients(3, 7, lambda i: i)[0]) == list(range(7))
    already = threading.Event()
    already.set()
    assert run_clients(4, None, lambda i: i, already)[0] == []


def test_a_clients_exception_is_raised_not_lost_with_its_thread():
    calls = []

    def one(i):
        calls.append(i)
        if i == 0:
            raise ConnectionError("the server went away")
        return i

    with pytest.raises(ConnectionError, match="went away"):
        run_clients(1, 5, one)
    assert calls == [0]  # the others stop beginning requests
