"""NATS users and permissions per role (DESIGN.md, "Trust boundaries and permissions"), rendered as nats-server
configuration, and the secure local layout `pulsescale nats --secure` runs: a user per role with a random
password, a self-signed CA and server certificate for TLS.

One table (`permissions`) is the source of both the local layout and the authorization the manifests ship
(the auth.conf in deploy/base/nats/configmap.yaml is `render_authorization` of example nodes, checked by
tests/manifests/test_manifests.py).

How JetStream maps onto subjects, which is what the permissions grant:
- a KV write is a publish to ``$KV.<bucket>.<key>``, so a key pattern confines a writer (an agent writes
  ``$KV.pulse_slots.*.<node>.*`` and ``$KV.pulse_agents.<node>`` only);
- a KV read is a JetStream API request: ``$JS.API.STREAM.INFO.KV_<bucket>`` to open the bucket,
  ``$JS.API.STREAM.MSG.GET.KV_<bucket>`` for a get (the stream leader answers, so a read follows the writes; the
  key is in the body, so reads are per bucket, not per key; ``$JS.API.DIRECT.GET.KV_<bucket>[.>]`` when a bucket
  was made with direct gets, as `nats kv add` does), and
  an ordered consumer for a watch (``$JS.API.CONSUMER.CREATE.KV_<bucket>.>``, ``CONSUMER.DELETE``, flow control
  answers on ``$JS.FC.KV_<bucket>.>``);
- creating a bucket or stream is ``$JS.API.STREAM.CREATE.<stream>``: only the autoscaler may (it creates them all
  at start, with rollup headers refused, and turns them off by ``$JS.API.STREAM.UPDATE.<stream>`` on a bucket an
  older version made), every other role opens what exists.

A key pattern confines where a writer publishes, not what the stream does with it: a rollup header
(``Nats-Rollup: all``) on a writer's own key would purge every key of the bucket, so the buckets refuse rollups.
And a consumer's deliver subject is not checked against its creator's publish grants: a reader of a bucket can
have its messages delivered onto any subject, so every handler checks the subject a message arrived on and where
it replies (`autoscaler.commands.service`, the agent's requests).

Revisions: 5 let the operator read the slots and ask ``status``, and on-call read the ScaledObjects; 6 (sharding)
lets the autoscaler, and only it, publish and subscribe ``pulse.autoscaler.>``: the replicas hand each other the
on-call commands of the models they own and ask each other for status rows there. 11 (agents bound to their
models) adds `pulse_assignments`: the operator writes it (``pulsescale assign``), the agents and the gateway only
read it (the gateway routes by it), the autoscaler (which reads every bucket and writes none of it) checks claims
against it. 13 (what the CR says) adds `pulse_objects`: the operator writes each ScaledObject CR's conditions there,
on-call reads them (``pulsescale get so``); the autoscaler creates it and only may read it, as every bucket.

Replies: each user receives on its own inbox, ``_INBOX.<user>.>`` (`connect` sets nats-py's inbox prefix from the
user name), so no role can read another's replies; a role that answers requests (agents, the autoscaler's
on-call commands) publishes its answers by ``allow_responses`` (only to the reply subject of a request it got),
never by a grant on ``_INBOX.>``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from warmpool import protocol
from warmpool.errors import PulsescaleError

__all__ = [
    "ROLES",
    "Permissions",
    "Role",
    "SecureLayout",
    "TlsFiles",
    "User",
    "inbox_prefix",
    "make_tls",
    "password_env",
    "permissions",
    "render_authorization",
    "write_private",
    "role_users",
    "write_secure_layout",
]

Role = Literal["gateway", "agent", "autoscaler", "operator", "oncall"]
ROLES: Final[tuple[Role, ...]] = ("gateway", "agent", "autoscaler", "operator", "oncall")


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May answer requests it received (to their reply subject only, once each)."""


@dataclass(frozen=True)
class User:
    name: str
    role: Role
    password: str
    """The password itself, or a ``$VARIABLE`` the server reads from its environment (the manifests)."""
    permissions: Permissions


def inbox_prefix(user: str) -> str:
    """Where `user` receives replies; its permissions allow subscribing there and nowhere else in ``_INBOX``."""
    return f"_INBOX.{user}"


def _kv_read(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _kv_write(bucket: str, keys: str = ">") -> list[str]:
    return [f"$KV.{bucket}.{keys}"]


def _stream_create(*streams: str) -> list[str]:
    return [f"$JS.API.STREAM.CREATE.{s}" for s in streams]


def _stream_update(*streams: str) -> list[str]:
    """The autoscaler turns rollups off on buckets an older version created (`registry.ensure_buckets`)."""
    return [f"$JS.API.STREAM.UPDATE.{s}" for s in streams]


def permissions(role: Role, node: str | None = None) -> Permissions:
    """What `role` may publish and subscribe (the agent's: of `node`)."""
    user = user_name(role, node)
    replies = f"{inbox_prefix(user)}.>"
    events = f"{protocol.EVENTS_PREFIX}>"
    if role == "gateway":
        return Permissions(
            # The ScaledObjects name the models a gateway queues for (an unknown one is 404 at once). Revision 11:
            # it reads `pulse_assignments` to route a ready slot only of a model its node may offer (an agent may
            # write a ready record of any model under its node, endpoint included).
            publish=(
                f"{protocol.QUEUE_PREFIX}>",
                *_kv_read(protocol.SLOTS_BUCKET),
                *_kv_read(protocol.SCALERS_BUCKET),
                *_kv_read(protocol.ASSIGNMENTS_BUCKET),
            ),
            subscribe=(events, replies),
        )
    if role == "agent":
        assert node is not None
        # No `pulse.events.>`: agents never publish events, and gateways route on `slot.ready` events.
        # Revision 11: `pulse_assignments` (the models its node may offer) is read only: a node's agent writes any
        # model under its node's keys, so what binds it to its models must be out of its reach.
        return Permissions(
            publish=(
                *_kv_read(protocol.SLOTS_BUCKET),
                *_kv_read(protocol.AGENTS_BUCKET),
                *_kv_read(protocol.ASSIGNMENTS_BUCKET),
                *_kv_write(protocol.SLOTS_BUCKET, f"*.{node}.*"),
                *_kv_write(protocol.AGENTS_BUCKET, node),
            ),
            subscribe=(f"{protocol.AGENT_PREFIX}{node}.>", replies),
            allow_responses=True,
        )
    if role == "autoscaler":
        # Revision 6: ``pulse.autoscaler.>`` both ways, for the hand-over between replicas: a front publishes a
        # command there for the replica owning its model, and asks the others for their status rows; each
        # replica subscribes its own ``pulse.autoscaler.<identity>.cmd.*``. No other role may: only a replica
        # that took the request off ``pulse.cmd.>`` (on-call's grant) may hand it on.
        handover = f"{protocol.REPLICA_PREFIX}>"
        return Permissions(
            publish=(
                f"{protocol.AGENT_PREFIX}*.>",
                handover,
                events,
                protocol.AUDIT_WILDCARD,
                *[s for b in protocol.BUCKETS for s in _kv_read(b)],
                *_kv_write(protocol.SLOTS_BUCKET),
                *_kv_write(protocol.LEASES_BUCKET),
                *_stream_create(*(f"KV_{b}" for b in protocol.BUCKETS), protocol.AUDIT_STREAM),
                *_stream_update(*(f"KV_{b}" for b in protocol.BUCKETS)),
                f"$JS.API.STREAM.INFO.{protocol.AUDIT_STREAM}",
            ),
            subscribe=(f"{protocol.QUEUE_PREFIX}>", f"{protocol.CMD_PREFIX}>", handover, replies),
            allow_responses=True,
        )
    if role == "operator":
        # Revision 5: it also reads the slots (standby pods follow their slot; the finalizer waits for releases),
        # asks the autoscaler for `status` (the status subresource) and reads events (Kubernetes Events, the cold
        # path). It may not send any other on-call command. Revision 11: it assigns nodes their models
        # (`pulse_assignments`), as it declares the models themselves. Revision 13: it mirrors each CR's conditions
        # into `pulse_objects` (opening the bucket is a read), the one writer there.
        return Permissions(
            publish=(
                *_kv_read(protocol.SCALERS_BUCKET),
                *_kv_write(protocol.SCALERS_BUCKET),
                *_kv_read(protocol.SLOTS_BUCKET),
                *_kv_read(protocol.ASSIGNMENTS_BUCKET),
                *_kv_write(protocol.ASSIGNMENTS_BUCKET),
                *_kv_read(protocol.OBJECTS_BUCKET),
                *_kv_write(protocol.OBJECTS_BUCKET),
                protocol.cmd_subject("status"),
            ),
            subscribe=(events, replies),
        )
    if role == "oncall":
        # Revision 5: reads the ScaledObjects (`pulsescale get scaledobjects`); writes nothing. Revision 13: and
        # what their CRs say (`pulse_objects`), so `get` agrees with the CRs' conditions without Kubernetes access.
        return Permissions(
            publish=(f"{protocol.CMD_PREFIX}>", *_kv_read(protocol.SCALERS_BUCKET), *_kv_read(protocol.OBJECTS_BUCKET)),
            subscribe=(replies,),
        )
    raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")


def user_name(role: Role, node: str | None = None) -> str:
    if role == "agent":
        if node is None or not protocol.is_name(node):
            raise PulsescaleError(f"node {node!r} is not a valid name ({protocol.NAME_PATTERN})")
        return f"agent-{node}"
    return role


def password_env(user: str) -> str:
    """The environment variable the server reads `user`'s password from (the manifests)."""
    return "PULSE_NATS_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", user.upper())


def role_users(nodes: Sequence[str], password: dict[str, str] | None = None) -> list[User]:
    """A user per role, one agent user per node. `password` maps user -> password; a user without one gets its
    `password_env` variable (the server resolves it from its environment)."""
    if len(set(nodes)) != len(nodes):
        raise PulsescaleError("a node is listed twice")
    out: list[User] = []
    for role in ROLES:
        for node in nodes if role == "agent" else [None]:
            name = user_name(role, node)
            pw = (password or {}).get(name) or f"${password_env(name)}"
            out.append(User(name, role, pw, permissions(role, node)))
    envs = [password_env(u.name) for u in out]
    if len(set(envs)) != len(envs):
        raise PulsescaleError("two node names map to the same password variable (they differ only in - and _)")
    return out


def _quote(text: str) -> str:
    if text.startswith("$"):
        return text  # a variable reference, resolved by the server
    if not re.fullmatch(r"[A-Za-z0-9_\-.]+", text):
        raise PulsescaleError(f"{text!r} cannot be written into a nats-server config safely")
    return f'"{text}"'


def _subjects(subjects: Iterable[str], indent: str) -> str:
    return "[\n" + "".join(f'{indent}  "{s}"\n' for s in subjects) + f"{indent}]"


def render_authorization(users: Sequence[User]) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server config, a subject per line for review."""
    lines = ["authorization {", "  users = ["]
    for u in users:
        p = u.permissions
        lines.append(f"    # {u.role}")
        lines.append(f"    {{user: {_quote(u.name)}, password: {_quote(u.password)}, permissions: {{")
        lines.append(f"      publish: {{allow: {_subjects(p.publish, '      ')}}}")
        lines.append(f"      subscribe: {{allow: {_subjects(p.subscribe, '      ')}}}")
        if p.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


# --- TLS ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path

    def server_block(self) -> str:
        return (
            f'tls {{\n  cert_file: "{self.server_cert}"\n  key_file: "{self.server_key}"\n'
            f'  ca_file: "{self.ca_cert}"\n  timeout: 2\n}}\n'
        )


def make_tls(directory: Path, *, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 365) -> TlsFiles:
    """A self-signed CA and a server certificate for `hosts` (IP addresses and DNS names), with the `openssl`
    CLI; the keys are 0600. Raises `PulsescaleError` without `openssl`."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PulsescaleError("openssl not found: TLS needs it to make the local CA and server certificate")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.crt"
    san = ",".join(f"IP:{h}" if re.fullmatch(r"[0-9.]+|[0-9a-fA-F:]+:[0-9a-fA-F:]*", h) else f"DNS:{h}" for h in hosts)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        r = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise PulsescaleError(f"openssl {args[0]} failed: {r.stderr.strip()}")

    old = os.umask(0o077)  # keys are created 0600
    try:
        run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_crt), "-days", str(days),
            "-subj", "/CN=pulsescale local CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        run("req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=pulsescale nats",
            "-addext", f"subjectAltName={san}")  # fmt: skip
        run("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(crt), "-days", str(days), "-copy_extensions", "copyall")  # fmt: skip
    finally:
        os.umask(old)
    csr.unlink(missing_ok=True)
    return TlsFiles(ca_cert=ca_crt, server_cert=crt, server_key=key)


# --- the local secure layout ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecureLayout:
    authorization: str
    """The server's authorization block (passwords inline; the file that holds it is 0600)."""
    tls: TlsFiles | None
    credentials: dict[str, Path]
    """User -> its environment file (``PULSESCALE_NATS_*``), 0600."""
    users: list[User]


def write_secure_layout(directory: Path, url: str, nodes: Sequence[str], *, tls: bool = True) -> SecureLayout:
    """Users with fresh random passwords, TLS files (unless `tls` is False) and one environment file per user
    under `directory` (0700; files 0600). Each run makes new passwords: a restart invalidates old credentials."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    names = [user_name(r, n) for r in ROLES for n in (nodes if r == "agent" else [None])]
    users = role_users(nodes, {n: secrets.token_urlsafe(24) for n in names})
    tls_files = make_tls(directory / "tls") if tls else None
    if tls_files is not None:
        url = url.replace("nats://", "tls://", 1)
    creds_dir = directory / "credentials"
    creds_dir.mkdir(exist_ok=True, mode=0o700)
    credentials: dict[str, Path] = {}
    for u in users:
        lines = [
            f"PULSESCALE_NATS_URL={url}",
            f"PULSESCALE_NATS_USER={u.name}",
            f"PULSESCALE_NATS_PASSWORD={u.password}",
        ]
        if tls_files is not None:
            lines.append(f"PULSESCALE_NATS_TLS_CA={tls_files.ca_cert}")
        if u.role == "agent":
            lines.append(f"PULSESCALE_NODE={u.name.removeprefix('agent-')}")
        path = creds_dir / f"{u.name}.env"
        write_private(path, "\n".join(lines) + "\n")
        credentials[u.name] = path
    return SecureLayout(render_authorization(users), tls_files, credentials, users)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, mode 0600, never through a link: credentials and configs that hold passwords."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of a credentials file."""
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out
