"""A stand-in OpenAI-compatible server for the ``command`` engine tests: stdlib only (it runs as the engine user,
under whatever Python that user can execute), ``/health`` and ``/v1/completions`` in the OpenAI shape.

    python openai_server_double.py --host H --port P [--behave ok|exit|never-healthy|slow]
        [--slot S --behave-for SLOT=KIND ...] [--health-path PATH]

``exit`` prints a line and exits 3 at once; ``never-healthy`` listens but answers 503 on /health forever; ``slow``
answers 503 for the first health checks (a server still loading), then 200. Completions echo the pid, so a test can
tell which process answered. It prints one line per request (its log is what the agent keeps). ``--health-path``
serves health on another path (a server whose readiness URL is not /health); every other GET, /health included
then, answers 404.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--behave", default="ok", choices=("ok", "exit", "never-healthy", "slow"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--slot", default="")
    p.add_argument("--behave-for", action="append", default=[], metavar="SLOT=KIND", help="another behaviour for SLOT")
    p.add_argument("--health-path", default="/health", help="the path health answers on (others: 404)")
    p.add_argument("--escape-child", action="store_true", help="fork a child into its own session (as vLLM's workers)")
    args = p.parse_args()
    if args.escape_child and os.fork() == 0:
        os.setsid()  # out of the server's process group: a group kill misses it
        while True:
            time.sleep(60)
    for item in args.behave_for:
        slot, _, kind = item.partition("=")
        if slot == args.slot:
            args.behave = kind
    print(f"double: pid {os.getpid()} uid {os.getuid()} behaving {args.behave}", flush=True)
    if args.behave == "exit":
        print("double: fatal: refusing to start (as asked)", file=sys.stderr, flush=True)
        return 3
    health_checks = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            print(f"double: {fmt % a}", flush=True)

        def _json(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != args.health_path:
                self._json(404, {"error": "not found"})
                return
            health_checks[0] += 1
            healthy = args.behave == "ok" or (args.behave == "slow" and health_checks[0] > 3)
            self._json(200 if healthy else 503, {"ok": healthy})

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            self._json(
                200,
                {
                    "id": f"cmpl-{time.time_ns()}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": req.get("model", args.model),
                    "choices": [{"index": 0, "text": f" pid{os.getpid()}", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                },
            )

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"double: listening on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
