"""NATS connection options shared by every daemon and CLI verb.

Flags win over ``PULSESCALE_NATS*`` environment variables, which win over defaults. Once connected, clients
reconnect forever (a daemon must outlive a broker restart); the *first* connection is bounded by
`connect_deadline_s` and fails with a `NatsUnavailable` that says what went wrong and what to check.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client

from warmpool.errors import NatsUnavailable

__all__ = ["NatsOptions", "add_nats_arguments", "connect", "options_from_args"]

log = logging.getLogger("pulsescale.nats")

DEFAULT_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class NatsOptions:
    servers: tuple[str, ...] = (DEFAULT_URL,)
    """Server URLs; several for a cluster (the client fails over between them)."""
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    """A `.creds` file (JWT + nkey seed), as issued by `nsc`."""
    tls_ca_file: str | None = None
    """CA bundle to verify the server's certificate; implies TLS."""
    name: str = "pulsescale"
    """Connection name shown in the server's monitoring (`/connz`)."""
    connect_deadline_s: float = 5.0
    """How long the first connection may take before we give up: long enough for a server that is starting,
    short enough that a typo in the URL is reported while the operator is still looking."""
    reconnect_wait_s: float = 0.25
    """Pause between reconnect attempts. Short: the registry is on the activation path."""
    request_timeout_s: float = 2.0
    """Default timeout of a JetStream API call (a KV compare-and-set is one)."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """More `nats.connect` keyword arguments (callbacks) for the daemon that owns the connection."""


_ENV = {
    "servers": "PULSESCALE_NATS_URL",
    "user": "PULSESCALE_NATS_USER",
    "password": "PULSESCALE_NATS_PASSWORD",
    "token": "PULSESCALE_NATS_TOKEN",
    "creds_file": "PULSESCALE_NATS_CREDS",
    "tls_ca_file": "PULSESCALE_NATS_TLS_CA",
}


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("NATS connection (flags override PULSESCALE_NATS_* environment variables)")
    g.add_argument("--nats", dest="nats_url", metavar="URL", help=f"server URL(s), comma-separated [{DEFAULT_URL}]")
    g.add_argument("--nats-user", metavar="USER")
    g.add_argument("--nats-password", metavar="PASSWORD")
    g.add_argument("--nats-token", metavar="TOKEN")
    g.add_argument("--nats-creds", metavar="FILE", help="credentials file (JWT + nkey seed)")
    g.add_argument("--nats-tls-ca", metavar="FILE", help="CA bundle; enables TLS")


def options_from_args(args: argparse.Namespace, *, name: str, env: Mapping[str, str] | None = None) -> NatsOptions:
    env = os.environ if env is None else env

    def pick(flag: str | None, key: str) -> str | None:
        return flag if flag else (env.get(_ENV[key]) or None)

    url = pick(getattr(args, "nats_url", None), "servers") or DEFAULT_URL
    return NatsOptions(
        servers=tuple(u.strip() for u in url.split(",") if u.strip()),
        user=pick(getattr(args, "nats_user", None), "user"),
        password=pick(getattr(args, "nats_password", None), "password"),
        token=pick(getattr(args, "nats_token", None), "token"),
        creds_file=pick(getattr(args, "nats_creds", None), "creds_file"),
        tls_ca_file=pick(getattr(args, "nats_tls_ca", None), "tls_ca_file"),
        name=name,
    )


def _explain(servers: tuple[str, ...], err: BaseException | None) -> str:
    where = ", ".join(servers)
    text = str(err) if err else "no answer"
    low = text.lower()
    if "authorization" in low or "authentication" in low or "permissions" in low:
        hint = "the server refused our credentials: check --nats-user/--nats-password, --nats-token or --nats-creds"
    elif "refused" in low or isinstance(err, ConnectionRefusedError):
        hint = "nothing listens there: is nats-server running, and is the URL/port right?"
    elif "certificate" in low or "ssl" in low or "tls" in low:
        hint = "TLS failed: check --nats-tls-ca and that the server's certificate matches its host name"
    else:
        hint = "check the URL, the network, and that the server has JetStream enabled (-js)"
    return f"cannot connect to NATS at {where}: {text}; {hint}"


async def connect(
    opts: NatsOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect, or raise `NatsUnavailable` within `opts.connect_deadline_s` saying why."""
    last_error: list[BaseException] = []

    async def error_cb(err: Exception) -> None:
        if not last_error or type(err) is not type(last_error[-1]):
            log.warning("nats: %s", err)
        last_error.append(err)
        del last_error[:-8]

    async def reconnected_cb() -> None:
        log.info("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        if on_reconnect is not None:
            await on_reconnect()

    async def disconnected_cb() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected from %s; reconnecting", ", ".join(opts.servers))
        if on_disconnect is not None:
            await on_disconnect()

    kwargs: dict[str, object] = {
        "servers": list(opts.servers),
        "name": opts.name,
        "error_cb": error_cb,
        "reconnected_cb": reconnected_cb,
        "disconnected_cb": disconnected_cb,
        "connect_timeout": max(1, int(opts.connect_deadline_s)),
        "reconnect_time_wait": opts.reconnect_wait_s,
        "max_reconnect_attempts": -1,
        **opts.extra,
    }
    if opts.user:
        kwargs["user"], kwargs["password"] = opts.user, opts.password
    if opts.token:
        kwargs["token"] = opts.token
    if opts.creds_file:
        if not os.path.exists(opts.creds_file):  # noqa: ASYNC240 - one stat at start-up
            raise NatsUnavailable(f"NATS credentials file {opts.creds_file} does not exist")
        kwargs["user_credentials"] = opts.creds_file
    if opts.tls_ca_file:
        try:
            kwargs["tls"] = ssl.create_default_context(cafile=opts.tls_ca_file)
        except (OSError, ssl.SSLError) as err:
            raise NatsUnavailable(f"cannot load NATS TLS CA {opts.tls_ca_file}: {err}") from None
    nc = Client()
    try:
        await asyncio.wait_for(nc.connect(**kwargs), timeout=opts.connect_deadline_s)  # type: ignore[arg-type]
    except (TimeoutError, OSError, nats.errors.Error) as err:
        await _close_quietly(nc)
        # A refusal of our credentials is followed by the server hanging up: report the refusal, not the hang-up.
        refusals = [e for e in last_error if "authoriz" in str(e).lower() or "authentic" in str(e).lower()]
        seen: list[BaseException | None] = [*(refusals or last_error)]
        cause = seen[-1] if seen else (None if isinstance(err, TimeoutError) else err)
        raise NatsUnavailable(_explain(opts.servers, cause)) from None
    return nc


async def _close_quietly(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - best effort on a connection that never came up
        pass
