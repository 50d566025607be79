"""Logging of the served app: our lines and uvicorn's, each written while a request is served naming its request id,
and a client's broken WebSocket frame reported in one line instead of uvicorn's traceback."""

from __future__ import annotations

import copy
import logging
from typing import Any

from uvicorn.config import LOGGING_CONFIG

from service.requestids import RequestIdFilter

SERVICE_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"  # request_tag: " [<request id>]"
# uvicorn's websockets-sansio protocol logs this with a traceback when a client's text frame is not UTF-8 (it then
# closes the connection with 1007, as RFC 6455 requires): the client's fault, not ours, so one warning line.
UVICORN_INVALID_UTF8 = "Invalid UTF-8 sequence received from client."


class ClientFaultFilter(logging.Filter):
    """Turns uvicorn's traceback for a WebSocket text frame that is not UTF-8 into a one-line warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage() == UVICORN_INVALID_UTF8:
            record.msg = "a WebSocket client sent a text frame that is not valid UTF-8; closed the connection with 1007"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config (pass it as `log_config`): ClientFaultFilter on its error logger, and the request
    id at the end of every access line and of its other lines written while serving a request."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {}).update(client_faults={"()": ClientFaultFilter}, request_id={"()": RequestIdFilter})
    config["loggers"]["uvicorn.error"]["filters"] = ["client_faults"]
    for handler in config["handlers"].values():
        handler["filters"] = ["request_id"]
        config["formatters"][handler["formatter"]]["fmt"] += "%(request_tag)s"
    return config


def configure(level: str) -> dict[str, Any]:
    """Set up our loggers at `level` ("info", ...) and return uvicorn's config for `uvicorn.run(log_config=...)`."""
    logging.basicConfig(level=level.upper(), format=SERVICE_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    return uvicorn_log_config()
