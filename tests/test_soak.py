"""`hkserve bench soak` for a few seconds on a tiny model, so the command cannot rot."""

from __future__ import annotations

import json

from helpers import hkserve
from test_serve import tiny_home  # noqa: F401  (module-scoped fixture: a tiny GGUF model in a store)

from hkserve.bench.soak import KINDS


def test_soak_sends_every_kind_of_request_and_reports_the_servers_rss_and_fds(tiny_home):  # noqa: F811
    args = ("bench", "soak", "--model", "tiny", "--seconds", "2", "--concurrency", "3", "--slots", "2")
    result = hkserve(*args, "--max-tokens", "8", "--json", home=tiny_home)
    report = json.loads(result.stdout.splitlines()[-1])
    assert set(report["by_kind"]) == set(KINDS) and all(report["by_kind"][k] for k in KINDS)
    assert report["by_kind"]["abort"] == {"aborted": report["by_kind"]["abort"]["aborted"]}
    assert set(report["by_kind"]["invalid"]) <= {"400", "404"}
    assert all(set(report["by_kind"][k]) == {"200"} for k in KINDS if k not in ("abort", "invalid"))
    assert report["unexpected"] == 0 and report["idle_after"] is True
    assert report["requests"] == sum(report["by_status"].values()) >= len(KINDS)
    for when in ("before", "after"):
        assert report[when]["rss_kb"] > 10_000 and report[when]["fds"] > 3
    assert report["rss_growth_pct"] == round(
        100 * (report["after"]["rss_kb"] - report["before"]["rss_kb"]) / report["before"]["rss_kb"], 2
    )
    assert "server RSS" in result.stdout and "open fds" in result.stdout
