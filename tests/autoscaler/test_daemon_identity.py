"""An autoscaler replica's identity names its shard leases, its replica record and the subject commands are handed
to it on: one key and subject token. A dotted host name still gives a valid default; a bad `--identity` is a usage
error, not a crash at start."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from autoscaler.daemon import default_identity
from warmpool import protocol


@pytest.mark.parametrize("host", ["node1.example.com", "gpu-7", "weird host*name>", ""])
def test_the_default_identity_is_one_token_whatever_the_host_name(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    identity = default_identity()
    assert protocol.is_identity(identity), identity
    assert protocol.replica_key(identity) == "replica." + identity


def test_a_bad_identity_is_refused_with_its_reason() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pulsescale", "autoscaler", "--identity", "a.b", "--nats", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "--identity 'a.b': use 1-128 letters, digits, '-' or '_'" in run.stderr
