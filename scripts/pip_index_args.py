"""Print `--extra-index-url URL` for pip when URL answers, else nothing (and a notice on stderr).

Used by the Makefile for TORCH_INDEX_URL: pip retries an unreachable index for every package it resolves
(about 70 s more for the dev set when the host name does not resolve, minutes when packets are dropped), so a
host without access to the CPU wheel index installs from pip's configured indexes alone.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 10


def answers(url: str) -> bool:
    """True when a server answers at `url` with any HTTP status (a 404 still means the host is reachable).

    Only http(s) URLs are probed; anything else (a file:// index) is handed to pip as it is.
    """
    if not url.startswith(("https://", "http://")):
        return True
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S):  # noqa: S310 (scheme checked above)
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    url = argv[1].strip() if len(argv) > 1 else ""
    if not url:
        return 0
    if answers(url):
        print(f"--extra-index-url {url}")
    else:
        print(f"pip_index_args: {url} does not answer; installing from pip's configured indexes only", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
