"""The agent <-> zygote pipe speaks typed messages: each kind round-trips, a malformed line is a named error."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent import staging
from nodeagent.engine import pipe
from nodeagent.forked import ForkedEngine
from tests.nodeagent.test_nodeagent_engine import spec

COMMANDS: list[pipe.Command] = [pipe.Start(port=8123), pipe.Start(), pipe.Stop(grace_s=2.0), pipe.Exit()]
EVENTS: list[pipe.Event] = [
    pipe.Armed(pid=10, prepare_ms=812.5, loader_note="host: mmap of the staged files"),
    pipe.Forked(pid=11),
    pipe.Serving(pid=11, port=8123, load_ms=3.25, boot_ms=40.0, bytes=1_048_576, mode="copied"),
    pipe.Failed(pid=11, stage="load", reason="WeightsChanged: shard.safetensors: inode differs"),
    pipe.Exited(pid=11, requested=False, signal="SIGKILL"),
    pipe.Exited(pid=11, requested=True, code=0),
    pipe.Exited(pid=None, requested=True),
    pipe.Error(reason="engine process 11 is still running; stop it first"),
    pipe.Error(reason="cannot arm: ValueError: no weights", fatal=True),
]


@pytest.mark.parametrize("msg", COMMANDS, ids=repr)
def test_every_command_round_trips_as_one_line_tagged_cmd(msg: pipe.Command) -> None:
    line = pipe.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["cmd"] == type(msg).__struct_config__.tag
    assert pipe.decode_command(line) == msg


@pytest.mark.parametrize("msg", EVENTS, ids=repr)
def test_every_event_round_trips_as_one_short_line_tagged_ev(msg: pipe.Event) -> None:
    line = pipe.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and len(line) < 4096  # PIPE_BUF: never interleaved
    assert json.loads(line)["ev"] == type(msg).__struct_config__.tag
    assert pipe.decode_event(line) == msg


def test_the_lines_keep_the_shape_the_raw_dicts_had() -> None:
    """The same keys as before the pipe was typed: an exit says its signal or its code, not both."""
    assert json.loads(pipe.encode(EVENTS[2])) == {
        "ev": "serving", "pid": 11, "port": 8123, "load_ms": 3.25, "boot_ms": 40.0, "bytes": 1 << 20, "mode": "copied",
    }  # fmt: skip
    assert json.loads(pipe.encode(EVENTS[4])) == {"ev": "exited", "pid": 11, "requested": False, "signal": "SIGKILL"}
    assert json.loads(pipe.encode(EVENTS[5])) == {"ev": "exited", "pid": 11, "requested": True, "code": 0}
    assert json.loads(pipe.encode(pipe.Stop(grace_s=2.0))) == {"cmd": "stop", "grace_s": 2.0}
    # What the agent wrote by hand before (and an older agent still would) decodes.
    assert pipe.decode_command(b'{"cmd": "exit"}\n') == pipe.Exit()
    assert pipe.decode_event(b'{"ev":"exited","pid":null,"requested":true,"code":null}') == EVENTS[6]
    assert pipe.decode_event(b'{"ev":"forked","pid":11,"later":"a field this side does not know"}') == EVENTS[1]


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            b'{"ev":"serving","pid":11,"load_ms":1.0,"boot_ms":2.0,"bytes":3,"mode":"copied"}',
            "missing required field `port`",
        ),
        (
            b'{"ev":"serving","pid":"11","port":1,"load_ms":1,"boot_ms":2,"bytes":3,"mode":"m"}',
            "Expected `int`, got `str`",
        ),
        (b'{"ev":"launched","pid":11}', "Invalid value 'launched'"),
        (b'{"pid":11}', "missing required field `ev`"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b"Traceback (most recent call last):", "JSON is malformed"),
    ],
)
def test_a_malformed_event_is_a_bad_message_that_says_what_is_wrong(line: bytes, said: str) -> None:
    with pytest.raises(pipe.BadMessage, match="bad event") as err:
        pipe.decode_event(line)
    assert said in str(err.value)


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b'{"cmd":"frobnicate"}', "Invalid value 'frobnicate'"),
        (b'{"cmd":"start","port":"8000"}', "Expected `int`, got `str`"),
        (b'{"port":8000}', "missing required field `cmd`"),
        (b"start 8000", "JSON is malformed"),
    ],
)
def test_a_malformed_command_is_a_bad_message_that_says_what_is_wrong(line: bytes, said: str) -> None:
    with pytest.raises(pipe.BadMessage, match="bad command") as err:
        pipe.decode_command(line)
    assert said in str(err.value)


class _FakeZygote:
    """Just what `ForkedEngine._read` reads: the event lines, then the exit."""

    def __init__(self, lines: list[bytes]) -> None:
        self.pid = 4242
        self.returncode: int | None = None
        self.stdout = asyncio.StreamReader()
        for line in lines:
            self.stdout.feed_data(line)
        self.stdout.feed_eof()

    async def wait(self) -> int:
        self.returncode = 0
        return 0


async def test_the_agent_logs_and_skips_a_malformed_event_instead_of_failing_on_a_missing_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = ForkedEngine({"engine": "local"}, name="s0", advertise_host="127.0.0.1")
    zygote: Any = _FakeZygote(
        [
            b'{"ev":"armed","prepare_ms":5.0}\n',  # no pid: not an event
            b"not json at all\n",
            pipe.encode(pipe.Armed(pid=4242, prepare_ms=12.5)),
        ]
    )
    with caplog.at_level(logging.WARNING, logger="pulsescale.agent.engine"):
        await engine._read(zygote)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(m.startswith("slot s0: zygote said") for m in said), said
    assert "missing required field `pid`" in said[0] and "JSON is malformed" in said[1]
    # The good line after the bad ones still armed it (then the zygote's exit disarmed it: no arm error).
    assert engine.prepare_ms == 12.5 and engine._arm_error is None


@pytest.fixture
def staged(model_dir: Path, shm_dir: Path) -> Iterator[staging.Staged]:
    out = staging.stage(model_dir, shm_dir, "tiny")
    yield out
    out.close()


async def test_a_real_zygote_answers_a_bad_command_with_an_error_and_keeps_serving(staged: staging.Staged) -> None:
    engine = ForkedEngine(spec(staged), name="s0", advertise_host="127.0.0.1")
    try:
        await engine.arm()
        assert engine._proc is not None and engine._proc.stdin is not None
        engine._events = asyncio.Queue()  # what a `start` or `stop` waiting on the zygote would see
        engine._proc.stdin.write(b'{"cmd": "launch", "port": 0}\n')
        ev = await asyncio.wait_for(engine._events.get(), 10)
        assert isinstance(ev, pipe.Error) and not ev.fatal
        assert "bad command" in ev.reason and "Invalid value 'launch'" in ev.reason
        engine._events = None
        started = await engine.start(timeout_s=10)
        # What reaches AgentSlotStatus.engine: the same keys and kinds of values as ever.
        status = engine.status()
        assert status == {
            "engine": "local",
            "armed": True,
            "zygote_pid": engine.zygote_pid,
            "arms": 1,
            "prepare_ms": status["prepare_ms"],
            "engine_pid": started.pid,
            "endpoint": started.endpoint,
        }
        assert isinstance(status["prepare_ms"], float) and status["prepare_ms"] > 0
        await engine.stop()
        assert engine.armed and engine.status()["engine_pid"] is None
    finally:
        await engine.close()
