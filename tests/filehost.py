"""A little real HTTP server on 127.0.0.1 that serves files, for download tests (no mocks)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

Route = Callable[[BaseHTTPRequestHandler], None]


@contextmanager
def serve_files(routes: Mapping[str, Route], log: list[str] | None = None) -> Iterator[str]:
    """Serve ``routes`` (path -> handler function) on 127.0.0.1:<free port>; yield the base URL.

    Unknown paths answer 404; requested paths are appended to ``log``. The server
    speaks HTTP/1.0, so each connection closes after one response (that is how a
    body can be cut short).
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if log is not None:
                log.append(self.path)
            route = routes.get(self.path.split("?")[0])
            if route is None:
                send_body(self, 404, b"not found\n", "text/plain")
            else:
                route(self)

        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

    with serve_handler(Handler) as url:
        yield url


@contextmanager
def serve_handler(handler: Callable[..., BaseHTTPRequestHandler]) -> Iterator[str]:
    """Run ``handler`` in a threading HTTP server on 127.0.0.1:<free port>; yield the base URL (no trailing slash)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def send_body(h: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def file_route(path: Path, *, content_length: bool = True) -> Route:
    """200 with the file's bytes (streamed), with or without a Content-Length."""

    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        if content_length:
            h.send_header("Content-Length", str(path.stat().st_size))
        h.end_headers()
        with path.open("rb") as f:
            shutil.copyfileobj(f, h.wfile, 1 << 20)

    return route


def redirect_route(location: str) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route
