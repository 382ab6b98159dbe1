"""A Locust file for the gateway, for those who drive load with Locust (``pip install locust``).

    locust -f gateway/locustfile.py --headless -u 20 -r 20 -t 60s --host http://127.0.0.1:8080

Each user sends one completion per second (``constant_throughput(1)``), so users = requests/s while the server keeps
up. 429s and 504s count as failures with their code in the name, so Locust's failure table is the 504 count.

The article's pulse: set ``PULSESCALE_PULSE=1`` and the shape below drives users (it ignores ``-u``/``-r``):
``PULSESCALE_BASE_USERS`` (10) for ``PULSESCALE_BASE_S`` (30 s), then ``PULSESCALE_PULSE_USERS`` (30: 300 %) spawned
within a second and held for ``PULSESCALE_HOLD_S`` (60 s), then the base for ``PULSESCALE_AFTER_S`` (30 s).
``PULSESCALE_MODEL`` (tiny) names the model. Locust's users wait for their answer before the next request (a closed
loop: an overloaded server slows the senders down); `pulsescale load` is open loop and counts 504s per second.

This file imports nothing of pulsescale: it runs wherever Locust does.
"""

from __future__ import annotations

import os

from locust import HttpUser, LoadTestShape, constant_throughput, task

MODEL = os.environ.get("PULSESCALE_MODEL", "tiny")
MAX_TOKENS = int(os.environ.get("PULSESCALE_MAX_TOKENS", "8"))


class CompletionUser(HttpUser):
    wait_time = constant_throughput(1)

    @task
    def complete(self) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": MAX_TOKENS}
        with self.client.post("/v1/completions", json=body, catch_response=True, name="/v1/completions") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")


if os.environ.get("PULSESCALE_PULSE"):

    class PulseShape(LoadTestShape):
        """Base users, a pulse to 3x within a second, held, back (module doc)."""

        base_users = int(os.environ.get("PULSESCALE_BASE_USERS", "10"))
        pulse_users = int(os.environ.get("PULSESCALE_PULSE_USERS", str(3 * base_users)))
        base_s = float(os.environ.get("PULSESCALE_BASE_S", "30"))
        hold_s = float(os.environ.get("PULSESCALE_HOLD_S", "60"))
        after_s = float(os.environ.get("PULSESCALE_AFTER_S", "30"))

        def tick(self) -> tuple[int, float] | None:
            t: float = self.get_run_time()  # type: ignore[no-untyped-call]  # (untyped in locust)
            if t < self.base_s:
                return self.base_users, float(self.base_users)
            if t < self.base_s + self.hold_s:
                return self.pulse_users, float(self.pulse_users)  # spawn rate = users/s: all within a second
            if t < self.base_s + self.hold_s + self.after_s:
                return self.base_users, float(self.pulse_users)
            return None
