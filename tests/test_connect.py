"""NATS connection options: flags over environment, and clear errors when the server is away or refuses us."""

from __future__ import annotations

import argparse
import time

import pytest

from warmpool import connect
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import NatsUnavailable


def parse(argv: list[str], env: dict[str, str]) -> connect.NatsOptions:
    p = argparse.ArgumentParser()
    connect.add_nats_arguments(p)
    return connect.options_from_args(p.parse_args(argv), name="t", env=env)


def test_flags_override_environment() -> None:
    env = {
        "PULSESCALE_NATS_URL": "nats://env:4222,nats://env2:4222",
        "PULSESCALE_NATS_TOKEN": "envtoken",
        "PULSESCALE_NATS_USER": "envuser",
        "PULSESCALE_NATS_CREDS": "/env.creds",
        "PULSESCALE_NATS_TLS_CA": "/ca",
    }
    o = parse([], env)
    assert o.servers == ("nats://env:4222", "nats://env2:4222")
    assert (o.token, o.user, o.creds_file, o.tls_ca_file) == ("envtoken", "envuser", "/env.creds", "/ca")
    o = parse(["--nats", "nats://flag:1", "--nats-token", "t2"], env)
    assert o.servers == ("nats://flag:1",) and o.token == "t2" and o.user == "envuser"
    assert parse([], {}).servers == (connect.DEFAULT_URL,)


async def test_unreachable_server_is_reported_quickly() -> None:
    opts = connect.NatsOptions(servers=(f"nats://127.0.0.1:{free_port()}",), connect_deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(NatsUnavailable, match="nothing listens there"):
        await connect.connect(opts)
    assert time.monotonic() - t0 < 5


async def test_refused_credentials_are_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    auth = 'authorization { user: "ops", password: "s3cret" }'
    with NatsServer(tmp_path, extra_config=auth) as server:
        bad = connect.NatsOptions(servers=(server.url,), user="ops", password="wrong", connect_deadline_s=1.5)
        with pytest.raises(NatsUnavailable, match="refused our credentials"):
            await connect.connect(bad)
        good = connect.NatsOptions(servers=(server.url,), user="ops", password="s3cret")
        nc = await connect.connect(good)
        assert nc.is_connected
        await nc.close()


async def test_token_auth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with NatsServer(tmp_path, extra_config='authorization { token: "tok" }') as server:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), token="tok"))
        assert nc.is_connected
        await nc.close()


async def test_missing_creds_file_is_named() -> None:
    with pytest.raises(NatsUnavailable, match="credentials file"):
        await connect.connect(connect.NatsOptions(creds_file="/nonexistent.creds"))


async def test_bad_tls_ca_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    with pytest.raises(NatsUnavailable, match="TLS CA"):
        await connect.connect(connect.NatsOptions(tls_ca_file=str(ca)))
