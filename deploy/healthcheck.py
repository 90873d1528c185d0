#!/opt/hkserve/bin/python
"""The image's HEALTHCHECK (and the Kubernetes probes' exec command): exit 0 when /health on this
container's port answers 200, else 1.

Python's urllib rather than curl, so the image needs no curl; the port is the one the server
listens on (HKSERVE_PORT, as the entrypoint passes it). A multi-host group's hosts other than 0
(HKSERVE_HOST_ID > 0) serve no HTTP: they are healthy while they run, since losing host 0 ends them."""

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


def main(environ=os.environ) -> int:
    if int(environ.get("HKSERVE_HOST_ID") or 0) > 0:
        return 0
    return 0 if healthy(int(environ.get("HKSERVE_PORT", "8000"))) else 1


if __name__ == "__main__":
    sys.exit(main())
