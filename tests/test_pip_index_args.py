"""scripts/pip_index_args.py: the Makefile passes TORCH_INDEX_URL to pip only when the index answers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pip_index_args import main
from servers import LOOPBACK, free_port


class NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def index_url() -> Iterator[str]:
    """A loopback HTTP server that answers every request with 404."""
    server = ThreadingHTTPServer((LOOPBACK, 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()
    thread.join()


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    assert main(["pip_index_args.py", *args]) == 0
    out, err = capsys.readouterr()
    return out.strip(), err.strip()


def test_an_index_that_answers_is_passed_even_with_an_error_status(capsys: pytest.CaptureFixture[str], index_url: str) -> None:
    assert run(capsys, index_url) == (f"--extra-index-url {index_url}", "")


def test_an_index_that_does_not_answer_is_left_out_with_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://{LOOPBACK}:{free_port()}/whl/cpu"
    out, err = run(capsys, url)
    assert out == "" and url in err and "does not answer" in err


@pytest.mark.parametrize(
    ("url", "expected"), [("", ""), ("  ", ""), ("file:///srv/wheels", "--extra-index-url file:///srv/wheels")]
)
def test_empty_means_none_and_other_schemes_are_not_probed(capsys: pytest.CaptureFixture[str], url: str, expected: str) -> None:
    assert run(capsys, url) == (expected, "")
