"""Entry point: `python -m service.api` reads Settings (TTS_* variables) and serves the app with uvicorn; the model
loads in the background (liveness and readiness answer meanwhile)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import NoReturn

from pydantic import ValidationError
from uvicorn.config import STARTUP_FAILURE

from service.api.app import create_app
from service.api.logconfig import configure as configure_logging
from service.api.serving import serve
from service.errors import BundleError, SettingError
from service.levers import LEVERS
from service.runtime import check_settings
from service.settings import Settings, moved_levers

# What to do about a busy port, in the terms of both ways of starting the server (the variable, or make's).
PORT_HINTS = {
    "TTS_PORT": "choose another port: TTS_PORT=8001, or `make run PORT=8001`",
    "TTS_GRPC_PORT": "choose another port: TTS_GRPC_PORT=50001, or `make run GRPC_PORT=50001`; 0 turns gRPC off",
}


def main() -> None:
    try:
        settings = Settings()
    except ValidationError as e:  # one line per bad setting, no traceback
        for err in e.errors():
            print(f"error: {_variable(err['loc'])}: {err['msg']}", file=sys.stderr)
        sys.exit(2)
    moved = moved_levers(os.environ)
    for line in moved:
        print(f"error: {line}", file=sys.stderr)
    if moved:
        sys.exit(2)
    for name, port in (("TTS_PORT", settings.port), ("TTS_GRPC_PORT", settings.grpc_port)):
        problem = _unavailable(settings.host, port) if port else None
        if problem:
            _refuse(name, f"cannot listen on {settings.host}:{port}: {problem} ({PORT_HINTS[name]})")
    try:
        check_settings(settings)  # what the model's family cannot honour, before uvicorn and the slow load
    except SettingError as e:
        _refuse(_variable((e.param or "",)), e.message)
    except BundleError as e:
        _refuse("TTS_MODEL_DIR", e.message)
    log_config = configure_logging(settings.log_level)
    app = create_app(settings, load_in_background=True, on_load_failure=exit_after_failed_load)
    if not serve(app, settings, log_config):
        sys.exit(STARTUP_FAILURE)


def _variable(loc: tuple[int | str, ...]) -> str:
    """How an operator sets the field at `loc`: `TTS_MAX_CHARS`, or `TTS_ENGINE_PROFILE lever first_hop_tokens`."""
    parts = [str(x) for x in loc if str(x) != "engine_profile"]
    if loc and (str(loc[0]) == "engine_profile" or (parts and parts[0] in LEVERS)):
        return f"TTS_ENGINE_PROFILE lever {'.'.join(parts)}" if parts else "TTS_ENGINE_PROFILE"
    return "TTS_" + "_".join(parts).upper()


def exit_after_failed_load() -> NoReturn:
    """The model could not be loaded (the log said why): end the process at once with status 1, so a supervisor
    restarts it or reports it, rather than it staying up `loading` for ever. Until then the server answered only
    liveness and 503 refusals and stored nothing, so there is nothing to drain."""
    logging.shutdown()  # flush every log line first
    os._exit(1)


def _refuse(setting: str, problem: str) -> NoReturn:
    """One line naming the setting and what is wrong with it, then exit 2 (no traceback)."""
    print(f"error: {setting}: {problem}", file=sys.stderr)
    sys.exit(2)


def _unavailable(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (in use, no such address), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


if __name__ == "__main__":
    main()
