"""`hkserve bench soak` for a few seconds on a tiny model, so the command cannot rot: its own server start
(bench/serve.py `serving`, waiting for the background compiles) included, at a 128-token context instead
of bench's 2048, whose many windows and buckets were most of this test's time and no part of the soak."""

from __future__ import annotations

import functools
import json

from test_serve import tiny_home  # noqa: F401  (module-scoped fixture: a tiny GGUF model in a store)

from hkserve.bench import soak
from hkserve.cli.main import main as hkserve_main


def test_soak_sends_every_kind_of_request_and_reports_the_servers_rss_and_fds(tiny_home, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("HKSERVE_HOME", str(tiny_home))
    # the server soak starts, as `hkserve bench soak` starts it, on a context the prompts fit (at most 8 + 8):
    # the engine shape of tests/test_serve.py's and test_sample.py's tiny runs, whose programs the run's
    # compile cache then serves
    monkeypatch.setattr(soak, "serving", functools.partial(soak.serving, max_len=128))
    args = ("bench", "soak", "--model", "tiny", "--seconds", "2", "--concurrency", "3", "--slots", "2")
    assert hkserve_main([*args, "--max-tokens", "8", "--json"]) == 0
    stdout = capsys.readouterr().out
    report = json.loads(stdout.splitlines()[-1])
    assert set(report["by_kind"]) == set(soak.KINDS) and all(report["by_kind"][k] for k in soak.KINDS)
    assert report["by_kind"]["abort"] == {"aborted": report["by_kind"]["abort"]["aborted"]}
    assert set(report["by_kind"]["invalid"]) <= {"400", "404"}
    assert all(set(report["by_kind"][k]) == {"200"} for k in soak.KINDS if k not in ("abort", "invalid"))
    assert report["unexpected"] == 0 and report["idle_after"] is True
    assert report["requests"] == sum(report["by_status"].values()) >= len(soak.KINDS)
    for when in ("before", "after"):
        assert report[when]["rss_kb"] > 10_000 and report[when]["fds"] > 3
    assert report["rss_growth_pct"] == round(
        100 * (report["after"]["rss_kb"] - report["before"]["rss_kb"]) / report["before"]["rss_kb"], 2
    )
    assert "server RSS" in stdout and "open fds" in stdout
