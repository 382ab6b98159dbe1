"""NATS connections for every daemon and CLI verb: options, the first connection, refusals.

Options come from flags, which win over ``PULSESCALE_NATS*`` environment variables, which win over defaults
(`add_nats_arguments`, `options_from_args`).

`connect` makes the first connection or raises `NatsUnavailable` with one message that says what went wrong and
what to check: at once when the server refuses our credentials (nats-py would otherwise retry them until the
deadline), and as soon as every server refused the connection outright or named no host that resolves (nothing
listens: `NatsUnreachable`, no wait), else within `NatsOptions.connect_deadline_s`; a URL of another scheme than
NATS's (``http://``) is `BadInput`, before any attempt. What goes wrong before that is collected for that
message, not logged, so a command fails with one line. Once connected, clients reconnect forever (a daemon must
outlive a broker restart) and log what the server reports. Messages nats-py drops for a subscriber that does not
keep up are counted and logged at most once per `NatsOptions.slow_consumer_log_interval_s` (and once more, with
what is left, at close): nats-py reports each one as its own error.

`run_client` is how a CLI verb uses a connection: connect, do the work, close; a permission violation the server
reports meanwhile ends the work with `PermissionDenied` (nats-py reports those only through the error callback,
and the refused publish or subscribe itself just goes unanswered, so a request would wait out its timeout).
`run_daemon` does the same for a daemon's start-up, until it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import nats
from nats.aio.client import Client

from warmpool import durations, natsauth
from warmpool.errors import BadInput, NatsUnavailable, NatsUnreachable, PermissionDenied

__all__ = [
    "NatsOptions",
    "SlowConsumerLog",
    "PermissionDenied",
    "add_nats_arguments",
    "connect",
    "flush_without_cancel",
    "options_from_args",
    "permission_denied",
    "run_client",
    "run_daemon",
]

log = logging.getLogger("pulsescale.nats")
# A library's logger: a daemon's logging configuration shows these records; a CLI that configures none does not
# get them from Python's last-resort handler as extra lines beside its one error line.
log.addHandler(logging.NullHandler())


class _TlsEofNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" whenever a TLS connection
    of nats-py's ends: noise, not a fault; without this filter a CLI's one error line gets a second one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_TlsEofNoise())

DEFAULT_URL: Final = "nats://127.0.0.1:4222"
DEFAULT_CONNECT_DEADLINE_S: Final = 5.0


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
    inbox_prefix: str | None = None
    """Where replies come in; None: ``_INBOX.<user>`` with a user name (so the server can confine each role to its
    own replies, `warmpool.natsauth`), else ``_INBOX``."""
    name: str = "pulsescale"
    """Connection name shown in the server's monitoring (`/connz`)."""
    connect_deadline_s: float = DEFAULT_CONNECT_DEADLINE_S
    """How long the first connection may take before we give up: long enough for a server that is starting,
    short enough that a typo in the URL is reported while the operator is still looking. A refusal of our
    credentials does not wait for it."""
    reconnect_wait_s: float = 0.25
    """Pause between reconnect attempts. Short: the registry is on the activation path."""
    request_timeout_s: float = 2.0
    """Default timeout of a JetStream API call (a KV compare-and-set is one)."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """More `nats.connect` keyword arguments (callbacks) for the daemon that owns the connection."""
    on_error: Callable[[Exception], Awaitable[None]] | None = None
    """Sees what the server reports once connected (a permission violation, say), after it is logged. An option
    rather than an argument of `connect` so that it reaches a daemon's own connection (`run_daemon`). Not the
    client's own slow-consumer drops: those are counted (`SlowConsumerLog`)."""
    slow_consumer_log_interval_s: float = 10.0
    """At most one log line per this many seconds about messages dropped for a slow subscriber: a flood drops
    tens of thousands a second, and nats-py reports each one (~92,000 lines per replica were seen)."""


_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+")  # a user name that is one subject token
_CONNECT_TIMEOUT_ENV: Final = "PULSESCALE_NATS_CONNECT_TIMEOUT"
_TEXT_OPTIONS: Final = (  # NatsOptions field, argparse dest, environment variable
    ("servers", "nats_url", "PULSESCALE_NATS_URL"),
    ("user", "nats_user", "PULSESCALE_NATS_USER"),
    ("password", "nats_password", "PULSESCALE_NATS_PASSWORD"),
    ("password_file", "nats_password_file", "PULSESCALE_NATS_PASSWORD_FILE"),
    ("token", "nats_token", "PULSESCALE_NATS_TOKEN"),
    ("creds_file", "nats_creds", "PULSESCALE_NATS_CREDS"),
    ("tls_ca_file", "nats_tls_ca", "PULSESCALE_NATS_TLS_CA"),
)


_seconds = durations.duration_arg()
"""A duration > 0 (``5s``, ``500ms``, plain seconds), as every other timeout flag reads one."""


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("NATS connection (flags override PULSESCALE_NATS_* environment variables)")
    g.add_argument("--nats", dest="nats_url", metavar="URL", help=f"server URL(s), comma-separated [{DEFAULT_URL}]")
    g.add_argument("--nats-user", metavar="USER")
    g.add_argument(
        "--nats-password",
        metavar="PASSWORD",
        help="visible in the process list: prefer --nats-password-file or $PULSESCALE_NATS_PASSWORD",
    )
    g.add_argument("--nats-password-file", metavar="FILE", help="read the password from FILE (a mounted Secret)")
    g.add_argument("--nats-token", metavar="TOKEN")
    g.add_argument("--nats-creds", metavar="FILE", help="credentials file (JWT + nkey seed)")
    g.add_argument("--nats-tls-ca", metavar="FILE", help="CA bundle; enables TLS")
    g.add_argument(
        "--nats-connect-timeout",
        type=_seconds,
        metavar="DURATION",
        help=f"give up on an unreachable server after this long (5s, 500ms) [${_CONNECT_TIMEOUT_ENV} or "
        f"{DEFAULT_CONNECT_DEADLINE_S:g}]",
    )


def options_from_args(args: argparse.Namespace, *, name: str, env: Mapping[str, str] | None = None) -> NatsOptions:
    """The options `add_nats_arguments` parsed, else the environment's, else the defaults. A bad connect timeout
    in the environment is a `NatsUnavailable` naming the variable (argparse checked the flag)."""
    env = os.environ if env is None else env
    text = {key: getattr(args, dest, None) or env.get(var) or None for key, dest, var in _TEXT_OPTIONS}
    deadline_s: float | None = getattr(args, "nats_connect_timeout", None)
    if deadline_s is None and env.get(_CONNECT_TIMEOUT_ENV):
        try:
            deadline_s = _seconds(env[_CONNECT_TIMEOUT_ENV])
        except argparse.ArgumentTypeError as err:
            raise NatsUnavailable(f"{_CONNECT_TIMEOUT_ENV}: {err}") from None
    url = text["servers"] or DEFAULT_URL
    if text["password_file"] and not text["password"]:
        try:
            text["password"] = Path(text["password_file"]).read_text().strip() or None
        except OSError as err:
            raise NatsUnavailable(f"cannot read the NATS password file {text['password_file']}: {err}") from None
    return NatsOptions(
        servers=tuple(u.strip() for u in url.split(",") if u.strip()),
        user=text["user"],
        password=text["password"],
        token=text["token"],
        creds_file=text["creds_file"],
        tls_ca_file=text["tls_ca_file"],
        name=name,
        connect_deadline_s=DEFAULT_CONNECT_DEADLINE_S if deadline_s is None else deadline_s,
    )


# --- what the server refused -------------------------------------------------------------------------------------


_PERMISSION_VIOLATION: Final = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"', re.I)


def permission_denied(err: BaseException) -> PermissionDenied | None:
    """The `PermissionDenied` an error from nats-py's error callback reports, or None for any other error."""
    m = _PERMISSION_VIOLATION.search(str(err))
    if m is None:
        return None
    operation: Literal["publish", "subscribe"] = "publish" if m.group(1).lower() == "publish" else "subscribe"
    return PermissionDenied(operation, _system_case(m.group(2)))


def _system_case(subject: str) -> str:
    """nats-py lower-cases the server's error text. Our own names are lower case; put back the upper case of the
    system subjects we use (``_INBOX.``, ``$KV.``, ``$JS.API.STREAM.INFO.KV_<bucket>``), since a permission is
    granted on the exact subject."""
    tokens = subject.split(".")
    if tokens[0] not in ("_inbox", "$kv", "$js"):
        return subject
    tokens[0] = tokens[0].upper()
    if tokens[0] == "$JS":  # API words are upper case up to the stream's name: KV_<bucket> or PULSE_AUDIT
        for i, token in enumerate(tokens[1:], start=1):
            if not token.isalpha():
                tokens[i] = "KV_" + token[3:] if token.startswith("kv_") else token.upper()
                break
            tokens[i] = token.upper()
    return ".".join(tokens)


def _refuses_credentials(err: BaseException) -> bool:
    """The server said no to who we are ('Authorization Violation', 'User Authentication Expired', ...): trying
    the same credentials again cannot help."""
    low = str(err).lower()
    return isinstance(err, nats.errors.AuthorizationError) or "authorization violation" in low or "authentic" in low


_SCHEMES: Final = ("nats", "tls", "ws", "wss")
"""The URL schemes nats-py connects with; a URL without one is ``nats://``."""


def check_urls(servers: tuple[str, ...]) -> None:
    """`BadInput` naming the URL and its scheme when one is not a NATS URL (``http://host:4222`` otherwise fails
    as "Name or service not known", after the whole connect deadline)."""
    for url in servers:
        scheme, sep, _ = url.partition("://")
        if sep and scheme.lower() not in _SCHEMES:
            raise BadInput(
                f"--nats {url}: {scheme}:// is not a NATS URL scheme; use nats://HOST:PORT (default port 4222), "
                "or tls://, ws://, wss://"
            )


def _nothing_there(err: BaseException) -> bool:
    """The server could not be reached at all and trying again at once will not change that: nothing listens
    (connection refused) or the host name does not resolve."""
    if isinstance(err, ConnectionRefusedError) or getattr(err, "errno", None) == errno.ECONNREFUSED:
        return True
    return isinstance(err, socket.gaierror) and err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5))


def _explain(servers: tuple[str, ...], err: BaseException | None) -> str:
    where = ", ".join(servers)
    text = str(err) if err else "no answer"
    low = text.lower()
    if err is not None and _refuses_credentials(err):
        hint = "the server refused our credentials: check --nats-user/--nats-password, --nats-token or --nats-creds"
    elif isinstance(err, socket.gaierror):
        hint = "the host name does not resolve: check the URL's host"
    elif "refused" in low or isinstance(err, ConnectionRefusedError):
        hint = "nothing listens there: is nats-server running, and is the URL/port right?"
    elif "certificate" in low or "ssl" in low or "tls" in low:
        hint = "TLS failed: check --nats-tls-ca and that the server's certificate matches its host name"
    else:
        hint = "check the URL, the network, and that the server has JetStream enabled (-js)"
    return f"cannot connect to NATS at {where}: {text}; {hint}"


# --- slow consumers ----------------------------------------------------------------------------------------------


class SlowConsumerLog:
    """Messages nats-py dropped because a subscription's pending queue was full: counted, and logged at most once
    per `interval_s` with how many since the last line and one subject they were on. nats-py reports every drop
    through the error callback, each with its own text (it names the subject), so logging each is a flood."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        """Messages dropped since the connection was made."""
        self._unreported = 0
        self._subject = ""
        self._last_logged: float | None = None

    def dropped(self, subject: str) -> None:
        self.total += 1
        self._unreported += 1
        self._subject = subject
        now = self.clock()
        if self._last_logged is None or now - self._last_logged >= self.interval_s:
            self.report(now)

    def report(self, now: float | None = None) -> None:
        """Log the drops not yet logged, if any (also at close, so none goes unsaid)."""
        if not self._unreported:
            return
        log.warning(
            "nats: slow consumer: dropped %d message(s) since the last report (%d in all; e.g. on %s): the "
            "subscriber does not keep up",
            self._unreported,
            self.total,
            self._subject,
        )
        self._unreported = 0
        self._last_logged = self.clock() if now is None else now


# --- connecting --------------------------------------------------------------------------------------------------

MIN_ATTEMPT_S: Final = 1.0
"""The least time one connection attempt gets (TCP, the server's INFO, TLS): a loaded server answers within it."""


def attempt_timeout_s(opts: NatsOptions) -> float:
    """How long one attempt on one server may take: a share of the first connection's deadline, so that a
    server that swallows packets (a dead node's address in a cluster: nothing refuses, nothing answers) leaves
    time to try the others in it, and a reconnect moves on from it as fast."""
    return max(MIN_ATTEMPT_S, opts.connect_deadline_s / max(1, len(opts.servers)))


async def connect(
    opts: NatsOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect, or raise `NatsUnavailable` saying why: at the first refusal of our credentials, as soon as every
    server refused the connection (`NatsUnreachable`), else within `opts.connect_deadline_s`."""
    check_urls(opts.servers)
    loop = asyncio.get_running_loop()
    connected = False
    early_errors: list[BaseException] = []
    refused: asyncio.Future[BaseException] = loop.create_future()
    nothing_there = 0  # consecutive attempts that found nothing listening: nats-py tries the servers in turn
    last_logged = ""
    slow = SlowConsumerLog(opts.slow_consumer_log_interval_s)

    async def error_cb(err: Exception) -> None:
        nonlocal last_logged, nothing_there
        if isinstance(err, nats.errors.SlowConsumerError):
            slow.dropped(err.subject)
            return
        if not connected:
            early_errors.append(err)
            del early_errors[:-8]
            nothing_there = nothing_there + 1 if _nothing_there(err) else 0
            # Every server refused (each was tried once, in turn): waiting out the deadline cannot help, and a
            # typo'd port would otherwise cost the whole deadline every time.
            if (_refuses_credentials(err) or nothing_there >= len(opts.servers)) and not refused.done():
                refused.set_result(err)
            return
        denied = permission_denied(err)
        text = str(denied) if denied is not None else f"nats: {str(err).removeprefix('nats: ')}"
        if text != last_logged:  # a reconnect loop repeats the same error; say it once
            log.warning("%s", text)
            last_logged = text
        if opts.on_error is not None:
            await opts.on_error(err)

    async def reconnected_cb() -> None:
        log.info("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        if on_reconnect is not None:
            await on_reconnect()

    async def disconnected_cb() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected from %s; reconnecting", ", ".join(opts.servers))
        if on_disconnect is not None:
            await on_disconnect()

    async def closed_cb() -> None:
        slow.report()

    kwargs: dict[str, object] = {
        "servers": list(opts.servers),
        "name": opts.name,
        "error_cb": error_cb,
        "reconnected_cb": reconnected_cb,
        "disconnected_cb": disconnected_cb,
        "closed_cb": closed_cb,
        "connect_timeout": attempt_timeout_s(opts),
        "reconnect_time_wait": opts.reconnect_wait_s,
        "max_reconnect_attempts": -1,
        **opts.extra,
    }
    if opts.user:
        kwargs["user"], kwargs["password"] = opts.user, opts.password
    prefix = opts.inbox_prefix or (
        natsauth.inbox_prefix(opts.user) if opts.user and _TOKEN.fullmatch(opts.user) else None
    )
    if prefix:
        kwargs["inbox_prefix"] = prefix
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
    attempt = asyncio.ensure_future(nc.connect(**kwargs))  # type: ignore[arg-type]
    try:
        try:
            first: set[asyncio.Future[Any]] = {attempt, refused}
            await asyncio.wait(first, timeout=opts.connect_deadline_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not attempt.done():
                attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
    except asyncio.CancelledError:
        # nats-py leaves a socket it opened to the garbage collector when its connect is cancelled.
        await _close_quietly(nc)
        raise
    if not attempt.cancelled() and attempt.exception() is None:
        connected = True
        refused.cancel()
        return nc
    await _close_quietly(nc)
    if refused.done() and not refused.cancelled():
        cause: BaseException | None = refused.result()
    elif early_errors:
        cause = early_errors[-1]
    else:
        failed = None if attempt.cancelled() else attempt.exception()
        cause = None if isinstance(failed, TimeoutError) else failed
    if cause is not None and _refuses_credentials(cause):
        raise NatsUnavailable(_explain(opts.servers, cause))  # refused: exit 1
    raise NatsUnreachable(_explain(opts.servers, cause))  # exit 3


async def _close_quietly(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - best effort on a connection that never came up
        pass


FLUSH_KEEP_S = 300
"""The flush's own timeout: past the connection's ping interval, so the PONG comes or the connection is made anew
(nats-py then drops its queued PONG futures) before it."""


async def flush_without_cancel(nc: Client, wait_s: float, background: set[asyncio.Task[None]]) -> bool:
    """`nc.flush()`, waited for at most `wait_s`; True when the PONG came in that time. A flush that has not is left
    to finish in `background` (held there, so it is not collected) instead of timing out: nats-py's
    ``flush(timeout)`` cancels its PONG's future on a timeout but leaves it queued, and the PONG that comes later
    raises in the connection's read loop (``InvalidStateError``), which ends it. The connection then hears nothing
    more while it looks connected: in `bench decide --models 3000 --replicas 3` on a loaded machine, autoscaler
    replicas whose 2 s flush after a takeover's re-subscription timed out took no sample again (6 of 16 runs logged
    the error; in 3, no model of the killed replica was claimed again and the ingest counted 0 samples)."""

    async def flush() -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await nc.flush(timeout=FLUSH_KEEP_S)

    task = asyncio.ensure_future(flush())
    done, _ = await asyncio.wait([task], timeout=wait_s)
    if not done:
        background.add(task)
        task.add_done_callback(background.discard)
    return bool(done)


T = TypeVar("T")


async def run_client(opts: NatsOptions, work: Callable[[Client], Awaitable[T]]) -> T:
    """Connect, run `work(nc)`, close. A permission violation the server reports meanwhile ends it with
    `PermissionDenied`, even when `work` itself finished (a denied publish looks sent)."""
    connected: list[Client] = []

    async def session(o: NatsOptions) -> T:
        connected.append(nc := await connect(o))
        result = await work(nc)
        # One more round trip: the server's refusal of a publish may come just after the answer to `work`'s own
        # flush (seen about once in ten runs with nats-server 2.15), never after a second one.
        await nc.flush()
        return result

    async def close() -> None:
        for nc in connected:
            await _close_quietly(nc)

    try:
        return await _until_denied(opts, session, armed=lambda: True, halt=close)
    finally:
        await close()


async def run_daemon(opts: NatsOptions, run: Callable[[NatsOptions], Awaitable[T]], ready: asyncio.Event) -> T:
    """Run a daemon, `run(opts)`, which connects by itself and sets `ready` once it serves. A permission the
    server refuses before then ends it with `PermissionDenied`: a role without the rights it needs fails at start,
    saying which, instead of half working or timing out; once it serves, a refusal is logged and it carries on."""
    return await _until_denied(opts, run, armed=lambda: not ready.is_set())


async def _until_denied(
    opts: NatsOptions,
    work: Callable[[NatsOptions], Awaitable[T]],
    *,
    armed: Callable[[], bool],
    halt: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """Run `work` with `opts` whose error hook ends it, while `armed()`, at the first permission violation.
    `halt` stops the work's connection before the work is cancelled: nats-py's reader fails on a flush that was
    cancelled while its answer was on the way."""
    denied: asyncio.Future[PermissionDenied] = asyncio.get_running_loop().create_future()

    async def on_error(err: Exception) -> None:
        refusal = permission_denied(err)
        if refusal is not None and armed() and not denied.done():
            denied.set_result(refusal)
        if opts.on_error is not None:
            await opts.on_error(err)

    task = asyncio.ensure_future(work(replace(opts, on_error=on_error)))
    try:
        either: set[asyncio.Future[Any]] = {task, denied}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if denied.done():  # also when `work` ended meanwhile: it failed or looked done because of the refusal
            raise denied.result()
        return task.result()
    finally:
        if not task.done():
            if halt is not None:
                await halt()
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        denied.cancel()
