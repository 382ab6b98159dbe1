"""`pulsescale bridge` as a user runs it: its help, its refusals (exit 2, one line), its config file, and the real
process reading an engine, publishing on NATS, serving /healthz and /metrics and stopping on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from bridge.cli import _parser, settings_from_args
from bridge.config import ConfigError
from bridge.settings import Query, Target
from tests.bridge.helpers import Engine, engines, samples_of
from tests.helpers import wait_for
from warmpool.embedded import NatsServer, free_port


def pulsescale(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsescale", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_help_reads_well() -> None:
    r = pulsescale("bridge", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for words in (
        "--target [MODEL=]URL",
        "vllm:num_requests_waiting is the queue depth",
        "--query MODEL=PROMQL",
        "never sent",
        "Needs only the gateway NATS role",
        "[250ms]",
        "[1s]",
        "examples:",
        "--scaledobjects",
        "The flags (and --config) win",
    ):
        assert words in text, words
    assert "bridge" in pulsescale("--help").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to read: give --target, --slots, --query or --scaledobjects"),
        (("--target", "ftp://h/m"), "give an http(s)://HOST[:PORT][/PATH] URL"),
        (("--target", "Bad.Name=http://h:1"), "does not match"),
        (("--target", "http://h:1", "--scrape-every", "1d"), "argument --scrape-every: '1d' is not a duration"),
        (("--target", "http://h:1", "--stale-after", "-1s"), "a duration cannot be negative"),
        (("--target", "http://h:1", "--stale-after", "300ms"), "a staleness bound must cover two periods"),
        (("--query", "m=up"), "--query needs --prometheus URL"),
        (("--prometheus", "http://p:9090", "--query", "m=up", "--query", "m=down"), "one query per model"),
        (("--target", "http://h:1", "--model-name", "Qwen=Bad.Name"), "give SERVED=MODEL"),
    ],
)
def test_bad_flags_are_refused_with_the_reason(args: tuple[str, ...], message: str) -> None:
    r = pulsescale("bridge", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def parse(*argv: str) -> argparse.Namespace:
    return _parser("pulsescale bridge").parse_args(list(argv))


def test_the_config_file_names_the_sources_and_flags_add_to_it(tmp_path: Path) -> None:
    f = tmp_path / "bridge.yaml"
    f.write_text(
        "targets:\n"
        "  - http://10.0.0.5:8000\n"
        "  - {url: 'http://10.0.0.6:8000/metrics', model: qwen}\n"
        "model_names: {Qwen/Qwen2.5-0.5B-Instruct: qwen}\n"
        "slots: true\n"
        "models: [qwen, llama]\n"
        "prometheus: http://prometheus:9090\n"
        "queries: {llama: 'sum(vllm:num_requests_running{model_name=\"llama\"})'}\n"
    )
    p = _parser("pulsescale bridge")
    s = settings_from_args(parse("--config", str(f), "--target", "llama=http://10.0.0.7:8000"), p)
    assert s.targets == (
        Target("http://10.0.0.5:8000/metrics"),
        Target("http://10.0.0.6:8000/metrics", "qwen"),
        Target("http://10.0.0.7:8000/metrics", "llama"),
    )
    assert s.names() == {"Qwen/Qwen2.5-0.5B-Instruct": "qwen"} and s.slots and s.models == {"qwen", "llama"}
    assert s.queries == (Query("llama", 'sum(vllm:num_requests_running{model_name="llama"})'),)
    assert s.prometheus_url == "http://prometheus:9090"
    s = settings_from_args(parse("--config", str(f), "--models", "qwen", "--prometheus", "http://p2:9090"), p)
    assert s.models == {"qwen"} and s.prometheus_url == "http://p2:9090"  # flags win


def test_scaledobjects_from_the_flag_or_the_file_is_enough_to_read(tmp_path: Path) -> None:
    p = _parser("pulsescale bridge")
    s = settings_from_args(parse("--scaledobjects"), p)
    assert s.scaledobjects and not s.slots and s.targets == () and s.queries == ()
    f = tmp_path / "bridge.yaml"
    f.write_text("scaledobjects: true\nmodels: [qwen]\n")
    s = settings_from_args(parse("--config", str(f)), p)
    assert s.scaledobjects and s.models == {"qwen"}
    assert not settings_from_args(parse("--config", str(f), "--target", "http://h:1"), p).slots
    # Which flag reads a model (the flags win over a ScaledObject's source for it).
    s = settings_from_args(
        parse("--scaledobjects", "--target", "a=http://h:1", "--target", "http://h:2", "--prometheus", "http://p:1",
              "--query", "b=up"),
        p,
    )  # fmt: skip
    assert (s.flagged("a"), s.flagged("b"), s.flagged("c")) == ("--target a=...", "--query b=...", None)
    s = settings_from_args(parse("--scaledobjects", "--slots", "--models", "a"), p)
    by_slots = s.flagged("a")
    assert by_slots is not None and by_slots.startswith("--slots") and s.flagged("c") is None  # --models leaves c out


def test_require_assignment_from_the_flag_or_the_file(tmp_path: Path) -> None:
    """Review finding 3: the secure deployment's `--require-assignment` (the gateway's flag) reaches the bridge."""
    p = _parser("pulsescale bridge")
    assert not settings_from_args(parse("--slots"), p).require_assignment
    assert settings_from_args(parse("--slots", "--require-assignment"), p).require_assignment
    f = tmp_path / "bridge.yaml"
    f.write_text("scaledobjects: true\nrequire_assignment: true\n")
    s = settings_from_args(parse("--config", str(f)), p)
    assert s.scaledobjects and s.require_assignment
    assert "--require-assignment" in " ".join(pulsescale("bridge", "--help").stdout.split())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("targets: http://h:1\n", "targets: a list"),
        ("require_assignment: 1\n", "require_assignment: true or false"),
        ("target: [http://h:1]\n", "unknown key(s) target"),
        ("targets: [{url: 'http://h:1', weight: 2}]\n", "give a URL, MODEL=URL or {url: URL, model: MODEL}"),
        ("slots: yes please\n", "slots: true or false"),
        ("scaledobjects: 1\n", "scaledobjects: true or false"),
        ("queries: {Bad.Name: up}\n", "MODEL matching"),
        ("targets: [\n", "not YAML"),
    ],
)
def test_a_bad_config_file_names_the_key(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bridge.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        settings_from_args(parse("--config", str(f)), _parser("pulsescale bridge"))
    assert message in str(err.value) and str(f) in str(err.value)
    r = pulsescale("bridge", "--config", str(f))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_an_unreachable_nats_is_one_line_and_exit_3() -> None:
    r = pulsescale("bridge", "--nats", f"nats://127.0.0.1:{free_port()}", "--target", "http://127.0.0.1:1")
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "nothing listens there" in r.stderr, r.stderr


async def test_the_process_publishes_serves_and_stops_on_sigterm(
    nats_server: NatsServer, nc: Client, tmp_path: Path
) -> None:
    port = free_port()
    async with engines(Engine()) as (e,):
        e.set(6, 2, 0)
        config = tmp_path / "bridge.yaml"
        config.write_text(f"targets: ['tiny={e.url}']\n")
        async with samples_of(nc, "tiny") as got:
            proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "pulsescale", "bridge", "--nats", nats_server.url, "--config", str(config),
                  "--listen", f"127.0.0.1:{port}", "--scrape-every", "100ms", "--log-level", "WARNING"],
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )  # fmt: skip
            try:
                await wait_for(lambda: got.last is not None, 20, "samples from the process")
                assert got.last is not None and (got.last.queue_depth, got.last.inflight) == (6, 2)
                assert got.last.gateway.startswith("bridge-")
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                        health = await r.json()
                        assert r.status == 200 and health["models"]["tiny"]["publishing"] is True
                    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                        text = await r.text()
                    assert f'pulsescale_bridge_reads_total{{source="{e.url}/metrics"}}' in text
                    assert 'pulsescale_bridge_errors_total{reason="timeout",source=' in text
                    assert 'pulsescale_bridge_reading_age_seconds{model="tiny"}' in text
                    assert 'component="bridge"' in text
                    async with s.get(f"http://127.0.0.1:{port}/other") as r:
                        assert r.status == 404
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.wait_for(proc.wait(), 10) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
