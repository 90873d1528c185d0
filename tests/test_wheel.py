"""The built wheel holds one top-level package, hkserve (no tests, configs or stray modules)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from helpers import REPO


def test_the_wheel_has_only_the_hkserve_package(tmp_path):
    # Built from a copy: setuptools' in-tree build/ would leak files of older trees into the wheel.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".venv", ".git", "build", "data", "runs", "*.egg-info", "__pycache__"),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("hkserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"hkserve"}, sorted(top)
    assert "hkserve/engine/runner.py" in names
    assert {"hkserve/api/web/index.html", "hkserve/api/web/app.js"} <= set(names)  # the chat page (package-data)
