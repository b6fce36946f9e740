"""Serves the bare repositories under one directory read-only over Git's smart HTTP protocol, by running
``git http-backend`` (Git's own CGI program) per request: what Flux's source-controller clones from.

    python3 git_http.py ROOT ADDRESS PORTFILE

Binds ADDRESS on a free port, writes the port to PORTFILE once it listens, and serves until killed. Pushes are
refused (``http.receivepack`` stays off): the repository's owner pushes to it as a local path.
"""
from __future__ import annotations

import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MAX_BODY = 16 << 20  # a fetch negotiation is a few KiB; anything larger is not a client of this server
TIMEOUT_S = 60


class Handler(BaseHTTPRequestHandler):
    root = ""
    timeout = TIMEOUT_S  # a client that stops sending does not hold its thread forever

    def do_GET(self) -> None:
        self.backend(b"")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.send_error(400, "Content-Length is not a number")
            return
        if not 0 <= length <= MAX_BODY or self.headers.get("Transfer-Encoding"):
            self.send_error(413, f"Content-Length must be 0-{MAX_BODY} bytes, not chunked")
            return
        self.backend(self.rfile.read(length))

    def backend(self, body: bytes) -> None:
        url = urlsplit(self.path)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": self.root,
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": url.path,
            "QUERY_STRING": url.query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
            "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
        }
        try:
            out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True,
                                 timeout=TIMEOUT_S, check=False).stdout
        except subprocess.TimeoutExpired:
            self.send_error(504, "git http-backend timed out")
            return
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def main() -> None:
    root, address, portfile = sys.argv[1:4]
    Handler.root = os.path.abspath(root)
    server = ThreadingHTTPServer((address, 0), Handler)
    tmp = portfile + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, portfile)
    server.serve_forever()


if __name__ == "__main__":
    main()
