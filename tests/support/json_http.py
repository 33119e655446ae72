"""The scripted HTTP services of the tests (a judge, a code sandbox): a JSON request handler
and a threaded server on 127.0.0.1 in a daemon thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_json(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog of 5 drops the SYNs of a burst of concurrent clients, which
    # retry a second later: a served reward's 64 requests took 6 s instead of 0.4 s.
    request_queue_size = 1024


class LocalServer:
    """``handler`` served on a free port of 127.0.0.1 until :meth:`close`."""

    def __init__(self, handler: type[JsonHandler]) -> None:
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
