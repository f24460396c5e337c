"""Run the service with uvicorn: in the foreground (``gaussdp serve``) or in a background thread.

Every server runs with the WebSocket bounds of :mod:`gaussdp.service.bounds` (messages of at most
128 KiB, no compression, no reading ahead of the application)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["ServerThread", "serve", "serve_factory"]


def uvicorn_options() -> dict[str, Any]:
    """The WebSocket bounds every server of the service runs with (see :mod:`gaussdp.service.bounds`)."""
    from gaussdp.service.bounds import uvicorn_options as options

    return options()


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_options())


def serve_factory(
    factory: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve the app ``factory`` (``"module:function"``) builds, in ``workers`` processes, until
    interrupted; with TLS when a certificate and key are given."""
    import uvicorn

    uvicorn.run(
        factory,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        **uvicorn_options(),
    )


class ServerThread:
    """A real uvicorn server on a free localhost port, in a daemon thread (tests, demo, benchmarks).

    >>> with ServerThread(app) as server:          # doctest: +SKIP
    ...     httpx.get(server.url + "/healthz")
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", log_level: str = "warning", ws: bool = False
    ) -> None:
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # bound before uvicorn starts: no race for the port
        self.host, self.port = self._sock.getsockname()[:2]
        options = uvicorn_options()
        if not ws:
            options["ws"] = "none"
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2, **options
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="gaussdp-server", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gaussdp server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
