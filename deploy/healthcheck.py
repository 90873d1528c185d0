#!/opt/hkserve/bin/python
"""The image's HEALTHCHECK: exit 0 when /health on this container's port answers 200, else 1.

Python's urllib rather than curl, so the image needs no curl; the port is the one the server
listens on (HKSERVE_PORT, as the entrypoint passes it)."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def healthy(port: int, timeout: float = 4.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # 503 while loading or draining, or nothing listening
        return False


if __name__ == "__main__":
    sys.exit(0 if healthy(int(os.environ.get("HKSERVE_PORT", "8000"))) else 1)
