"""Serving the app with uvicorn, whose shutdown drains every transport by one deadline (TTS_DRAIN_TIMEOUT_S)."""

from __future__ import annotations

import logging
import socket
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI

from service.api.deps import AppState
from service.settings import Settings

log = logging.getLogger("uvicorn.error")  # uvicorn's own lines ("Shutting down", ...), which tests and operators read
CLOSE_GRACE_S = 2.0  # after the deadline: for the 503s and 1001 closes made at the deadline to reach their clients
POLL_S = 0.1  # how often the drain checks whether every connection is gone (uvicorn's own interval)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the app's drain (`service.api.drain.Drain`) as its shutdown.

    uvicorn's own shutdown fails every WebSocket with 1012 at once, waits `timeout_graceful_shutdown` for HTTP, then
    runs the lifespan's end, where gRPC got a grace period of its own: a session lost its sentence and the whole took
    up to twice the setting. Here, at SIGTERM, the listeners close and the drain begins at the same moment (gRPC
    refuses new calls, sessions finish their sentence and close with 1001, idle keep-alive connections close), every
    connection gets until the drain's deadline (plus `CLOSE_GRACE_S` for the answers made at it), and only then is
    what is left cut and the lifespan ended (the engine stopped).
    """

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("Shutting down")
        deadline = self.state.drain.begin()
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in self._connections(websockets=False):
            connection.shutdown()  # idle keep-alive connections close now, busy ones after their response
        await self._wait_for_connections(deadline + CLOSE_GRACE_S)
        for connection in self._connections(websockets=True):
            connection.shutdown()  # a session that did not close by the deadline: uvicorn's 1012
        for task in self.server_state.tasks:
            task.cancel(msg="the drain's deadline has passed")
        if not self.force_exit:
            await self.lifespan.shutdown()

    def _connections(self, *, websockets: bool) -> list[Any]:
        """The open connections that are WebSocket sessions (`websockets`), or the HTTP ones."""
        return [c for c in self.server_state.connections if self._is_websocket(c) is websockets]

    def _is_websocket(self, connection: object) -> bool:
        ws_protocol = self.config.ws_protocol_class
        return ws_protocol is not None and isinstance(connection, ws_protocol)

    async def _wait_for_connections(self, until: float) -> None:
        """Until no connection is left, or `until` (anyio's clock), or a second Ctrl+C."""
        if self.server_state.connections:
            log.info("Waiting for connections to close. (CTRL+C to force quit)")
        while self.server_state.connections and not self.force_exit and anyio.current_time() < until:
            await anyio.sleep(POLL_S)


def serve(app: FastAPI, settings: Settings, log_config: dict[str, Any] | None) -> bool:
    """Serve `app` (built by `create_app`) on TTS_HOST:TTS_PORT until SIGTERM/SIGINT and its drain are over (blocking);
    False when the server never started (the lifespan failed, the port was taken)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level, log_config=log_config)
    state = app.state.tts
    assert isinstance(state, AppState)
    server = DrainingServer(config, state)
    server.run()
    return server.started
