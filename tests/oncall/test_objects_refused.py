"""`pulsescale get so` and `describe so` with an on-call NATS authorization rendered before contract revision 13
(review finding 7): that user may read `pulse_scalers` but not `pulse_objects`, and the server refuses the read. The
commands show what `pulse_scalers` holds, as before revision 13, with one warning on stderr naming the fix, instead of
failing. Against a real nats-server with that authorization, a running `CommandService` answering status, and the
current on-call user beside it for contrast."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from oncall.get import objects_refused
from pulsescale import cli as dispatcher
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, serving
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore, ensure_buckets


def before_revision_13() -> natsauth.Permissions:
    """The on-call role as rendered before revision 13: today's, less every subject of `pulse_objects`."""
    now = natsauth.permissions("oncall")
    old = tuple(s for s in now.publish if protocol.OBJECTS_BUCKET not in s)
    assert len(old) < len(now.publish) and any(protocol.SCALERS_BUCKET in s for s in old)
    return natsauth.Permissions(old, now.subscribe, now.allow_responses)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    role = natsauth.permissions("oncall")  # its replies come to _INBOX.<user>: this user's own
    today = natsauth.Permissions(role.publish, (f"{natsauth.inbox_prefix('oncall13')}.>",), role.allow_responses)
    users = [
        natsauth.User("admin", "autoscaler", "admin-pw", natsauth.Permissions((">",), (">",), allow_responses=True)),
        natsauth.User("oncall", "oncall", "oncall-pw", before_revision_13()),
        natsauth.User("oncall13", "oncall", "oncall13-pw", today),
    ]
    with NatsServer(tmp_path / "nats", extra_config=natsauth.render_authorization(users)) as s:
        yield s


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[Client]:
    nc = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="admin-pw"))
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def objects(admin: Client) -> AsyncIterator[None]:
    """qwen published (its record in `pulse_scalers`); ``broken``, a CR never published, only in `pulse_objects`;
    an autoscaler answering status."""
    kv = await ensure_buckets(admin.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.OBJECTS_BUCKET])
    rec = protocol.ScalerRecord(namespace="default", name="qwen", spec=make_spec("qwen"), updated_at=1.0)
    await kv[protocol.SCALERS_BUCKET].put(rec.key, protocol.encode(rec))
    broken = protocol.ObjectStatus(
        namespace="default", name="broken", published=False, updated_at=1.0,
        conditions=[protocol.ObjectCondition(type="Ready", status="False", reason="InvalidSpec", message="bad")],
    )  # fmt: skip
    await kv[protocol.OBJECTS_BUCKET].put(broken.key, protocol.encode(broken))
    store = await KvSlotStore.open(admin)
    try:
        async with serving(admin, ControlPlaneDouble({"qwen": make_spec("qwen")}), store):
            yield
    finally:
        await store.close()


async def pulsescale(
    server: NatsServer, capsys: pytest.CaptureFixture[str], user: str, *argv: str
) -> tuple[int, str, str]:
    """`pulsescale ARGV` as `user` (its own event loop, in a thread): (exit code, stdout, stderr)."""
    auth = ["--nats", server.url, "--nats-user", user, "--nats-password", f"{user}-pw"]
    code = await asyncio.to_thread(dispatcher.main, [*argv, *auth])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.usefixtures("objects")
async def test_get_so_without_pulse_objects_shows_pulse_scalers_and_names_the_fix(
    server: NatsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await pulsescale(server, capsys, "oncall", "get", "so")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["qwen"]  # not `broken`: only its CR knows it
    [warning] = err.splitlines()
    assert warning.startswith("warning: this NATS user may not read pulse_objects (permission denied on ")
    assert "KV_pulse_objects" in warning and "pulsescale nats --print-authorization" in warning
    assert "only what pulse_scalers holds" in warning

    code, out, err = await pulsescale(server, capsys, "oncall", "describe", "so", "qwen")
    assert code == 0, err
    assert "qwen" in out and len(err.splitlines()) == 1 and "pulse_objects" in err

    # The current on-call role reads both, without a word on stderr.
    code, out, err = await pulsescale(server, capsys, "oncall13", "get", "so")
    assert (code, err) == (0, "")
    assert sorted(line.split()[0] for line in out.splitlines()[1:]) == ["broken", "qwen"]


def test_only_a_refusal_of_pulse_objects_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    """Any other refusal still ends the command (exit 1, naming the subject), and pulse_objects' only once."""
    take = objects_refused(argparse.Namespace())
    assert not take(connect.PermissionDenied("publish", "$JS.API.STREAM.INFO.KV_pulse_slots"))
    assert not take(connect.PermissionDenied("publish", "$KV.pulse_objectsx.a"))
    assert take(connect.PermissionDenied("publish", "$JS.API.CONSUMER.CREATE.KV_pulse_objects.x.y"))
    assert not take(connect.PermissionDenied("publish", "$JS.API.STREAM.INFO.KV_pulse_objects"))  # taken already
    assert len(capsys.readouterr().err.splitlines()) == 1
