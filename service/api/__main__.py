"""Entry point: `python -m service.api` reads Settings (TTS_* variables) and serves the app with uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from service.api.app import create_app
from service.settings import Settings


def main() -> None:
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.drain_timeout_s,
    )


if __name__ == "__main__":
    main()
