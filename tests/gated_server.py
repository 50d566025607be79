"""`python tests/gated_server.py`: the app as `python -m service.api` serves it, its engine wrapped in a FileGate.

The gate file is TEST_GATE_FILE; it is created (open) at start unless TEST_GATE_CLOSED=1, which holds the warm-up
(so the app stays loading: /healthz 200, /readyz and synthesis 503) until the test opens it. Tests close it to hold
every stream after its current chunk (see tests/gated_engine.py) and open it again to let the streams finish.
TEST_GATE_RELEASES_CANCELLED=1: a cancelled stream is not held (GatedEngine's `releases_cancelled`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from uvicorn.config import STARTUP_FAILURE

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gated_engine import FileGate, GatedEngine

from service.api.__main__ import exit_after_failed_load
from service.api.app import create_app
from service.api.logconfig import configure as configure_logging
from service.api.serving import serve
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.cosyvoice1.model import load_synthesizer
from service.settings import Settings
from service.speech.service import Engine


def main() -> None:
    gate = FileGate(Path(os.environ["TEST_GATE_FILE"]))
    if os.environ.get("TEST_GATE_CLOSED") != "1":
        gate.set()

    def loader(bundle: ModelBundle, runtime: RuntimeOptions) -> Engine:
        releases = os.environ.get("TEST_GATE_RELEASES_CANCELLED") == "1"
        return GatedEngine(load_synthesizer(bundle, runtime), gate, releases_cancelled=releases)

    settings = Settings()
    log_config = configure_logging(settings.log_level)  # as `python -m service.api` logs
    app = create_app(settings, engine_loader=loader, load_in_background=True, on_load_failure=exit_after_failed_load)
    if not serve(app, settings, log_config):  # as `python -m service.api` serves it, its drain included
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
