"""The suite's file order (tests/conftest.py `pytest_collection_modifyitems`): longest first by
tests/file_seconds.json, each file's tests kept in their order, so `make test`'s two workers end together."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from conftest import pytest_collection_modifyitems

TESTS = Path(__file__).parent


def test_every_file_the_table_names_exists():
    """A renamed or removed file left in the table would leave its successor unweighted, at the end."""
    seconds = json.loads((TESTS / "file_seconds.json").read_text())
    assert sorted(name for name in seconds if not (TESTS / name).is_file()) == []
    assert all(isinstance(s, int | float) and s >= 0 for s in seconds.values())


def test_files_go_longest_first_and_keep_their_tests_order():
    seconds = json.loads((TESTS / "file_seconds.json").read_text())
    longest = max(seconds, key=seconds.get)
    shorter = next(name for name in seconds if 0 < seconds[name] < seconds[longest])
    names = ["test_not_in_the_table_a.py", shorter, "test_not_in_the_table_b.py", longest]
    items = [SimpleNamespace(path=TESTS / name, index=(name, i)) for name in names for i in range(3)]
    pytest_collection_modifyitems(items)
    assert [item.index for item in items] == [
        (name, i)
        for name in [longest, shorter, "test_not_in_the_table_a.py", "test_not_in_the_table_b.py"]
        for i in range(3)
    ]
