"""A stand-in for a vLLM server process tree: answers ``GET /health`` on the port it is given and
starts a child process (as vLLM starts its engine core) that lives as long as it does. Where
``$STANDIN_SCRATCH`` names a directory it leaves a file there, as vLLM leaves its ZMQ sockets.

    python -m tests.support.health_server PORT [--exit-after S]
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main() -> None:
    port = int(sys.argv[1])
    if "--exit-after" in sys.argv:
        delay = float(sys.argv[sys.argv.index("--exit-after") + 1])
        threading.Timer(delay, lambda: os._exit(3)).start()
    if scratch := os.environ.get("STANDIN_SCRATCH"):
        Path(scratch, "engine.sock").touch()
    # The "engine core": a grandchild of the supervisor, in the server's process group.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    server.serve_forever()


if __name__ == "__main__":
    time.sleep(0.2)  # as a real server, not ready at once
    main()
