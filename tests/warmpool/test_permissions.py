"""The whole chain under the production's NATS layout (`pulsescale nats --secure`: a user per role, TLS), then
each role refused what it must not do (DESIGN.md, "Trust boundaries and permissions").

Real processes throughout: a nats-server with the users `warmpool.natsauth` renders, the autoscaler and two node
agents as `pulsescale` processes with their own users, `pulsescale apply` as the operator, `pulsescale sample`
as the gateway and `pulsescale status` as on-call. The chain must run without a single permission violation in
the server's log: every role has what it needs, and nothing is waited out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import nats.js.errors
import pytest
from nats.aio.client import Client

from tests.helpers import wait_for
from tests.nodeagent_helpers import MODEL
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import NatsUnavailable, PermissionDenied, PulsescaleError
from warmpool.registry import BucketView, ensure_buckets
from warmpool.rejects import Rejections

NODES = ("n1", "n2")
SCALED_OBJECT = f"""
apiVersion: pulsescale.io/v1alpha1
kind: ScaledObject
metadata: {{name: {MODEL}, namespace: test}}
spec:
  scaleTargetRef: {{name: {MODEL}}}
  minReplicaCount: 0
  maxReplicaCount: 1
  cooldownPeriod: 1
  triggers:
    - type: gateway-queue
      metadata: {{model: {MODEL}, targetQueueDepth: 4}}
  advanced:
    stableWindowSeconds: 1
    panicWindowSeconds: 0.5
    scaleDownStabilizationSeconds: 0.5
    scaleDownPeriodSeconds: 0.5
    scaleDownPercent: 100
"""
VIOLATION = "Violation"  # nats-server logs "Publish Violation" / "Subscription Violation" per refusal


class Secure:
    def __init__(self, server: NatsServer, layout: natsauth.SecureLayout) -> None:
        self.server, self.layout = server, layout

    def env(self, user: str) -> dict[str, str]:
        return {**os.environ, **natsauth.read_env_file(self.layout.credentials[user])}

    def options(self, user: str) -> connect.NatsOptions:
        return connect.options_from_args(argparse.Namespace(), name=f"test-{user}", env=self.env(user))

    def run(self, user: str, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pulsescale", *argv],
            env=self.env(user),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def violations(self, since: int = 0) -> list[str]:
        return [line for line in self.server.log_path.read_text()[since:].splitlines() if VIOLATION in line]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    root = tmp_path_factory.mktemp("secure-nats")
    server = NatsServer(root / "nats")
    layout = natsauth.write_secure_layout(root / "auth", server.url, NODES, tls=shutil.which("openssl") is not None)
    server.extra_config, server.tls = layout.authorization, layout.tls
    with server:
        yield Secure(server, layout)


@contextlib.contextmanager
def processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `pulsescale` processes; all are stopped (SIGTERM, then SIGKILL) at exit, even on failure."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], *argv: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, "-m", "pulsescale", *argv], env=env)
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in started:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def with_client(secure: Secure, user: str, work: Callable[[Client], Awaitable[object]]) -> object:
    return await connect.run_client(secure.options(user), work)


def test_the_layout_has_a_user_per_role_and_private_files(secure: Secure) -> None:
    assert sorted(secure.layout.credentials) == sorted(
        ["gateway", "autoscaler", "operator", "oncall", *(f"agent-{n}" for n in NODES)]
    )
    for path in secure.layout.credentials.values():
        assert path.stat().st_mode & 0o777 == 0o600
    conf = secure.server.store_dir / "nats-server.conf"
    assert conf.stat().st_mode & 0o777 == 0o600  # it holds the passwords
    if secure.layout.tls is not None:
        assert secure.server.url.startswith("tls://")
        assert secure.layout.tls.server_key.stat().st_mode & 0o777 == 0o600


async def test_the_chain_runs_under_role_permissions_without_a_violation(
    secure: Secure, tiny_source: Path, tmp_path: Path
) -> None:
    since = len(secure.server.log_path.read_text())
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SCALED_OBJECT)
    shm = [Path("/dev/shm") / f"pulsescale-perm-{os.getpid()}-{secrets.token_hex(3)}-{n}" for n in NODES]
    gateway = await connect.connect(secure.options("gateway"))
    view: BucketView[protocol.SlotRecord] | None = None
    watch: asyncio.Task[None] | None = None
    try:
        with processes() as start:
            start(secure.env("autoscaler"), "autoscaler", "--metrics-port", "0", "--log-level", "WARNING")

            async def slots_bucket() -> object:
                # The gateway may read pulse_slots, never create it: the autoscaler does, at its start.
                with contextlib.suppress(nats.js.errors.BucketNotFoundError):
                    return await gateway.jetstream(timeout=2.0).key_value(protocol.SLOTS_BUCKET)
                return None

            await wait_for(slots_bucket, 20, "the autoscaler to create the buckets")
            applied = await asyncio.to_thread(secure.run, "operator", "apply", "-f", str(spec))
            assert applied.returncode == 0, applied.stderr
            assert f"scaledobject test.{MODEL} created" in applied.stdout
            for node, shm_dir in zip(NODES, shm, strict=True):
                start(secure.env(f"agent-{node}"), "agent", "--slots", "1", "--model", str(tiny_source),
                      "--model-name", MODEL, "--shm-dir", str(shm_dir), "--metrics-port", "-1",
                      "--log-level", "WARNING")  # fmt: skip
            kv = await gateway.jetstream(timeout=2.0).key_value(protocol.SLOTS_BUCKET)
            view = BucketView(gateway, kv, protocol.SlotRecord, Rejections(logging.getLogger("test")))
            watch = asyncio.create_task(view.run())

            def states() -> dict[str, str]:
                assert view is not None
                return {r.node: r.state for r in view.values()}

            await wait_for(lambda: states() == {n: "warm" for n in NODES}, 30, f"both agents warm ({states()})")
            pulse = asyncio.create_task(
                asyncio.to_thread(secure.run, "gateway", "sample", MODEL, "--queue-depth", "4", "--for", "8")
            )
            await wait_for(lambda: "ready" in states().values(), 20, f"a slot ready ({states()})")
            ready = next(r for r in view.values() if r.state == "ready")
            assert ready.endpoint
            status = await asyncio.to_thread(secure.run, "oncall", "status")
            assert status.returncode == 0, status.stderr
            assert MODEL in status.stdout
            sent = await pulse
            assert sent.returncode == 0, sent.stderr
        assert secure.violations(since) == []
    finally:
        if view is not None:
            view.closed = True
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        await gateway.close()
        for d in shm:
            shutil.rmtree(d, ignore_errors=True)


async def test_the_hand_over_between_replicas_runs_under_the_autoscalers_user(secure: Secure) -> None:
    """Two replicas as the autoscaler's user, on-call as its own: commands for either model from either front,
    and a status merged over both, without a permission violation (revision 6, ``pulse.autoscaler.>``)."""
    from autoscaler.commands.service import CommandService
    from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, request
    from tests.autoscaler.test_commands_routing import FixedRouter
    from warmpool.registry import KvSlotStore

    since = len(secure.server.log_path.read_text())
    owners: dict[str, str | None] = {"qwen": "b", "llama": "a"}
    async with contextlib.AsyncExitStack() as stack:
        conns = {i: await connect.connect(secure.options("autoscaler")) for i in ("a", "b")}
        for conn in conns.values():
            stack.push_async_callback(conn.close)
        store = await KvSlotStore.open(conns["a"])
        services = []
        for ident, conn in conns.items():
            control = ControlPlaneDouble({m: make_spec(m, 0, 8) for m in owners})
            svc = CommandService(conn, control, store, router=FixedRouter(ident, dict(owners), ["a", "b"]))
            await svc.start()
            stack.push_async_callback(svc.stop)
            services.append(svc)
        oncall = await connect.connect(secure.options("oncall"))
        stack.push_async_callback(oncall.close)
        for i in range(12):
            body = request("scale", model=("qwen", "llama")[i % 2], replicas=1, for_s=60)
            msg = await oncall.request(protocol.cmd_subject("scale"), json.dumps(body).encode(), timeout=3)
            assert json.loads(msg.data)["ok"], msg.data
        msg = await oncall.request(protocol.cmd_subject("status"), json.dumps(request("status")).encode(), timeout=3)
        reply = json.loads(msg.data)
        assert reply["ok"] and reply.get("error") is None, reply
        assert {(r["model"], r["owner"]) for r in reply["models"]} == {("qwen", "b"), ("llama", "a")}
        assert sum(s.outcomes["handed_over"] for s in services) > 0
    assert secure.violations(since) == []


# --- what each role must not do ---------------------------------------------------------------------------------


def publish(subject: str, payload: bytes = b"{}") -> Callable[[Client], Awaitable[object]]:
    async def work(nc: Client) -> None:
        await nc.publish(subject, payload)
        await nc.flush()

    return work


def kv_put(bucket: str, key: str) -> Callable[[Client], Awaitable[object]]:
    """A KV write is a publish to ``$KV.<bucket>.<key>``: refused on the subject, whatever the client library."""
    return publish(f"$KV.{bucket}.{key}")


def subscribe(subject: str) -> Callable[[Client], Awaitable[object]]:
    async def work(nc: Client) -> None:
        await nc.subscribe(subject)
        await nc.flush()

    return work


@pytest.mark.parametrize(
    ("user", "work", "operation", "subject"),
    [
        ("gateway", publish("pulse.agent.n1.activate"), "publish", "pulse.agent.n1.activate"),
        ("gateway", kv_put(protocol.SLOTS_BUCKET, f"{MODEL}.n1.0"), "publish", f"$KV.pulse_slots.{MODEL}.n1.0"),
        ("agent-n1", kv_put(protocol.SLOTS_BUCKET, f"{MODEL}.n2.0"), "publish", f"$KV.pulse_slots.{MODEL}.n2.0"),
        ("agent-n1", kv_put(protocol.AGENTS_BUCKET, "n2"), "publish", "$KV.pulse_agents.n2"),
        ("agent-n1", publish("pulse.agent.n2.deactivate"), "publish", "pulse.agent.n2.deactivate"),
        ("agent-n1", subscribe("pulse.agent.n2.>"), "subscribe", "pulse.agent.n2.>"),
        ("agent-n1", publish("pulse.queue.tiny"), "publish", "pulse.queue.tiny"),
        ("oncall", kv_put(protocol.SCALERS_BUCKET, "test.tiny"), "publish", "$KV.pulse_scalers.test.tiny"),
        ("oncall", kv_put(protocol.LEASES_BUCKET, "override.tiny"), "publish", "$KV.pulse_leases.override.tiny"),
        ("oncall", subscribe("_INBOX.>"), "subscribe", "_INBOX.>"),  # nobody else's replies
        ("operator", kv_put(protocol.SLOTS_BUCKET, f"{MODEL}.n1.0"), "publish", f"$KV.pulse_slots.{MODEL}.n1.0"),
        ("autoscaler", kv_put(protocol.SCALERS_BUCKET, "test.tiny"), "publish", "$KV.pulse_scalers.test.tiny"),
        ("autoscaler", kv_put(protocol.AGENTS_BUCKET, "n1"), "publish", "$KV.pulse_agents.n1"),
        # Revision 6: only autoscaler replicas hand each other commands; on-call goes through pulse.cmd.>.
        ("oncall", publish("pulse.autoscaler.a.cmd.scale"), "publish", "pulse.autoscaler.a.cmd.scale"),
        ("operator", publish("pulse.autoscaler.a.cmd.status"), "publish", "pulse.autoscaler.a.cmd.status"),
        ("gateway", subscribe("pulse.autoscaler.>"), "subscribe", "pulse.autoscaler.>"),
        # Revision 11: the models a node may offer are the operator's to write; its own agent only reads them.
        ("agent-n1", kv_put(protocol.ASSIGNMENTS_BUCKET, "n1"), "publish", "$KV.pulse_assignments.n1"),
        ("autoscaler", kv_put(protocol.ASSIGNMENTS_BUCKET, "n1"), "publish", "$KV.pulse_assignments.n1"),
        ("oncall", kv_put(protocol.ASSIGNMENTS_BUCKET, "n1"), "publish", "$KV.pulse_assignments.n1"),
        # Revision 13: what the CRs say is the operator's to write; on-call reads it, nobody else writes it.
        ("oncall", kv_put(protocol.OBJECTS_BUCKET, "test.tiny"), "publish", "$KV.pulse_objects.test.tiny"),
        ("autoscaler", kv_put(protocol.OBJECTS_BUCKET, "test.tiny"), "publish", "$KV.pulse_objects.test.tiny"),
        ("agent-n1", kv_put(protocol.OBJECTS_BUCKET, "test.tiny"), "publish", "$KV.pulse_objects.test.tiny"),
        ("gateway", kv_put(protocol.OBJECTS_BUCKET, "test.tiny"), "publish", "$KV.pulse_objects.test.tiny"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_a_role_is_refused_what_it_must_not_do(
    secure: Secure, user: str, work: Callable[[Client], Awaitable[object]], operation: str, subject: str
) -> None:
    with pytest.raises(PermissionDenied) as refused:
        await with_client(secure, user, work)
    assert (refused.value.operation, refused.value.subject) == (operation, subject)
    assert str(refused.value).startswith(f"refused: permission denied on {subject} (")


@pytest.mark.parametrize(
    ("user", "argv", "subject"),
    [
        ("gateway", ["scale", MODEL, "--replicas", "1"], "pulse.cmd.scale"),
        ("agent-n1", ["apply", "-f", "-"], f"$JS.API.STREAM.INFO.KV_{protocol.SCALERS_BUCKET}"),
        ("oncall", ["sample", MODEL, "--queue-depth", "9"], f"pulse.queue.{MODEL}"),
        ("operator", ["pause", MODEL], "pulse.cmd.pause"),
        ("gateway", ["schedule", MODEL, "--list"], "pulse.cmd.schedule"),
        ("agent-n1", ["drain", "n2"], "pulse.cmd.drain"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v[:1]),
)
def test_a_refused_command_is_one_line_and_exit_1(secure: Secure, user: str, argv: list[str], subject: str) -> None:
    """Real processes, as a person runs them with the wrong role's credentials."""
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", *argv],
        env=secure.env(user),
        input=SCALED_OBJECT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    # apply writes pulse_scalers, which only the operator's user may: the refusal says whose user it needs.
    hint = "; writing pulse_scalers needs the operator's NATS user" if argv[0] == "apply" else ""
    assert r.stderr.splitlines() == [
        f"pulsescale {argv[0]}: refused: permission denied on {subject} (this NATS user may not publish to it: "
        f"use the user of the right role, or grant it in the server's authorization){hint}"
    ]


async def test_a_client_with_a_wrong_password_is_refused(secure: Secure) -> None:
    opts = secure.options("gateway")
    with pytest.raises(NatsUnavailable, match="refused our credentials"):
        await connect.connect(connect.NatsOptions(**{**opts.__dict__, "password": "wrong"}))


async def test_a_client_without_tls_is_refused(secure: Secure) -> None:
    if secure.layout.tls is None:
        pytest.skip("openssl not found: the secure layout runs without TLS, so there is no TLS to refuse")
    opts = secure.options("gateway")
    plain = secure.server.url.replace("tls://", "nats://")
    with pytest.raises(NatsUnavailable):
        await connect.connect(connect.NatsOptions(**{**opts.__dict__, "servers": (plain,), "tls_ca_file": None}))


# --- `pulsescale nats --secure` --------------------------------------------------------------------------------


def test_pulsescale_nats_secure_prints_the_credentials_and_any_start_order_works(tmp_path: Path) -> None:
    """The command as a person runs it: it prints a credentials file per user (0600) and how to use it, and has
    made the buckets, so `apply` (which may not create them) works before any autoscaler ran."""
    store = tmp_path / "nats"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "nats", "--secure", "--port", str(port), "--store-dir", str(store),
         "--nodes", "gpu-0,gpu-1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # blocks on the child's output; the process ends on error (EOF)
            lines.append(line.rstrip("\n"))
            if line.startswith("or as flags:"):
                break
        out = "\n".join(lines)
        creds = store / "secure" / "credentials"
        for user in ("gateway", "agent-gpu-0", "agent-gpu-1", "autoscaler", "operator", "oncall"):
            path = creds / f"{user}.env"
            assert str(path) in out, out
            assert path.stat().st_mode & 0o777 == 0o600
        assert f"(set -a; . {creds / 'agent-gpu-0.env'}; pulsescale agent --model DIR)" in out
        assert natsauth.read_env_file(creds / "agent-gpu-0.env")["PULSESCALE_NODE"] == "gpu-0"
        env = {**os.environ, **natsauth.read_env_file(creds / "operator.env")}
        if shutil.which("openssl"):
            assert env["PULSESCALE_NATS_URL"] == f"tls://127.0.0.1:{port}" and "PULSESCALE_NATS_TLS_CA" in env
        applied = subprocess.run([sys.executable, "-m", "pulsescale", "apply", "-f", "-"], input=SCALED_OBJECT,
                                 env=env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert applied.returncode == 0, applied.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_each_agent_user_writes_only_its_own_nodes_keys() -> None:
    perms = natsauth.permissions("agent", "gpu-0")
    kv_writes = [s for s in perms.publish if s.startswith("$KV.")]
    assert kv_writes == ["$KV.pulse_slots.*.gpu-0.*", "$KV.pulse_agents.gpu-0"]
    assert f"$JS.API.STREAM.INFO.KV_{protocol.ASSIGNMENTS_BUCKET}" in perms.publish  # it reads its assignment
    assert perms.subscribe == ("pulse.agent.gpu-0.>", "_INBOX.agent-gpu-0.>")
    assert not any(s.startswith("$JS.API.STREAM.CREATE") for s in perms.publish)
    assert not any(s.startswith("_INBOX") for s in perms.publish)  # answers go by allow_responses only


def test_node_names_that_would_share_a_password_variable_are_refused() -> None:
    with pytest.raises(PulsescaleError, match="same password variable"):
        natsauth.role_users(["gpu-0", "gpu_0"])


def test_the_password_can_come_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    opts = connect.options_from_args(argparse.Namespace(), name="t", env={"PULSESCALE_NATS_PASSWORD_FILE": str(secret)})
    assert opts.password == "s3cret"


def test_an_agent_started_before_the_buckets_exist_says_who_creates_them(tiny_source: Path, tmp_path: Path) -> None:
    """Only the autoscaler may create buckets: an agent that starts first is refused, and says what to do."""
    server = NatsServer(tmp_path / "nats")
    layout = natsauth.write_secure_layout(tmp_path / "auth", server.url, ["n1"], tls=False)
    server.extra_config = layout.authorization
    shm = Path("/dev/shm") / f"pulsescale-perm-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        with server:
            env = {**os.environ, **natsauth.read_env_file(layout.credentials["agent-n1"])}
            argv = ["agent", "--slots", "1", "--model", str(tiny_source), "--shm-dir", str(shm), "--metrics-port", "-1"]
            agent = subprocess.run(
                [sys.executable, "-m", "pulsescale", *argv], env=env, capture_output=True, text=True, timeout=60
            )
        assert agent.returncode == 1, agent.stderr
        last = agent.stderr.strip().splitlines()[-1]
        assert "permission denied on $JS.API.STREAM.CREATE.KV_pulse_slots" in last
        assert "the autoscaler creates the registry's buckets when it starts, so start it first" in last
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# --- revision 11: the shipped authorization keeps an agent off its own assignment -----------------------------------


async def test_the_shipped_authorization_lets_an_agent_read_but_not_write_its_assignment(tmp_path: Path) -> None:
    """deploy/base/nats/configmap.yaml's auth.conf on a real nats-server (its password variables filled in here,
    as the Secret fills them there): the operator assigns gpu-0 its model; gpu-0's agent reads it, and is refused
    writing it, whether it widens its own list or deletes it."""
    from tests.manifests.test_manifests import example_nodes

    node = example_nodes()[0]
    server = shipped_server(tmp_path)
    agent = f"agent-{node}"
    with server:
        await connect.run_client(shipped_user(server, "autoscaler"), buckets)  # only the autoscaler creates them
        await connect.run_client(shipped_user(server, "operator"), assign(node, "qwen"))
        assert (await connect.run_client(shipped_user(server, agent), read(node))).models == ["qwen"]
        subject = f"$KV.{protocol.ASSIGNMENTS_BUCKET}.{node}"
        for work in (kv_put(protocol.ASSIGNMENTS_BUCKET, node), delete_assignment(node)):
            with pytest.raises(PermissionDenied) as refused:
                await connect.run_client(shipped_user(server, agent), work)
            assert (refused.value.operation, refused.value.subject) == ("publish", subject)
        assert (await connect.run_client(shipped_user(server, agent), read(node))).models == ["qwen"]


async def test_the_shipped_authorization_lets_the_gateway_route_by_the_assignments_but_not_write_them(
    tmp_path: Path,
) -> None:
    """The same shipped auth.conf: the gateway user reads `pulse_assignments` (a get, and the reference gateway
    itself, which watches it and routes by it) without a single permission violation in the server's log, and is
    refused writing or deleting an assignment (a gateway could otherwise bind a node to what it routes)."""
    from gateway.proxy import Gateway, GatewaySettings
    from tests.manifests.test_manifests import example_nodes

    node = example_nodes()[0]
    server = shipped_server(tmp_path)
    with server:
        await connect.run_client(shipped_user(server, "autoscaler"), buckets)
        await connect.run_client(shipped_user(server, "operator"), assign(node, "qwen"))
        since = len(server.log_path.read_text())
        assert (await connect.run_client(shipped_user(server, "gateway"), read(node))).models == ["qwen"]

        async def route(nc: Client) -> None:
            settings = GatewaySettings(nats=shipped_user(server, "gateway"), port=0, gateway_id="gw-test")
            async with Gateway(settings, nc) as gw:
                await wait_for(lambda: gw.routes.listed.is_set(), 15, "the gateway to list the slots")
                assert gw.health()["assignments"] == "listed"
                assert gw.routes.assigned.rule.allows("qwen", node) and not gw.routes.assigned.rule.allows("x", node)

        await connect.run_client(shipped_user(server, "gateway"), route)
        assert [line for line in server.log_path.read_text()[since:].splitlines() if VIOLATION in line] == []
        subject = f"$KV.{protocol.ASSIGNMENTS_BUCKET}.{node}"
        for work in (kv_put(protocol.ASSIGNMENTS_BUCKET, node), delete_assignment(node)):
            with pytest.raises(PermissionDenied) as refused:
                await connect.run_client(shipped_user(server, "gateway"), work)
            assert (refused.value.operation, refused.value.subject) == ("publish", subject)
        assert (await connect.run_client(shipped_user(server, "operator"), read(node))).models == ["qwen"]


def shipped_server(tmp_path: Path) -> NatsServer:
    """A nats-server with deploy/base/nats/configmap.yaml's auth.conf, each ``$PULSE_NATS_PASSWORD_<USER>`` filled
    in as ``pw-<user>`` (as the Secret fills them there)."""
    from tests.manifests.test_manifests import nats_config

    filled = r'{user: "\1", password: "pw-\1",'
    auth = re.sub(r'\{user: "([^"]+)", password: \$\w+,', filled, nats_config()["auth.conf"])
    return NatsServer(tmp_path / "nats", extra_config=auth)


def shipped_user(server: NatsServer, user: str) -> connect.NatsOptions:
    return connect.NatsOptions(servers=(server.url,), user=user, password=f"pw-{user}", name=f"test-{user}")


async def buckets(nc: Client) -> None:
    await ensure_buckets(nc.jetstream(timeout=5.0), harden=True)


def assign(node: str, *models: str) -> Callable[[Client], Awaitable[object]]:
    async def work(nc: Client) -> None:
        kv = await nc.jetstream(timeout=5.0).key_value(protocol.ASSIGNMENTS_BUCKET)
        await kv.put(node, protocol.encode(protocol.NodeAssignment(node=node, models=list(models))))

    return work


def read(node: str) -> Callable[[Client], Awaitable[protocol.NodeAssignment]]:
    async def work(nc: Client) -> protocol.NodeAssignment:
        kv = await nc.jetstream(timeout=5.0).key_value(protocol.ASSIGNMENTS_BUCKET)
        entry = await kv.get(node)
        assert entry.value is not None
        return protocol.decode(entry.value, protocol.NodeAssignment)

    return work


def delete_assignment(node: str) -> Callable[[Client], Awaitable[object]]:
    async def work(nc: Client) -> None:
        await nc.publish(f"$KV.{protocol.ASSIGNMENTS_BUCKET}.{node}", b"", headers={"KV-Operation": "DEL"})
        await nc.flush()

    return work


# --- revision 13: the shipped authorization lets on-call read what the CRs say, and only the operator write it -----


async def test_the_shipped_authorization_lets_oncall_read_the_crs_conditions_and_only_the_operator_write_them(
    tmp_path: Path,
) -> None:
    """deploy/base/nats/configmap.yaml's auth.conf on a real nats-server (passwords filled in as in the revision 11
    test): the operator writes an `ObjectStatus` into `pulse_objects` and deletes it; on-call reads it (what
    `pulsescale get so` does) and is refused writing or deleting it."""
    from tests.manifests.test_manifests import nats_config

    filled = r'{user: "\1", password: "pw-\1",'
    auth = re.sub(r'\{user: "([^"]+)", password: \$\w+,', filled, nats_config()["auth.conf"])
    server = NatsServer(tmp_path / "nats", extra_config=auth)
    key = "inference.broken"
    record = protocol.ObjectStatus(
        namespace="inference", name="broken", published=False, updated_at=1.0,
        conditions=[protocol.ObjectCondition(type="Ready", status="False", reason="InvalidSpec", message="bad")],
    )  # fmt: skip

    def options(user: str) -> connect.NatsOptions:
        return connect.NatsOptions(servers=(server.url,), user=user, password=f"pw-{user}", name=f"test-{user}")

    async def buckets(nc: Client) -> None:
        await ensure_buckets(nc.jetstream(timeout=5.0), harden=True)

    async def write(nc: Client) -> None:
        kv = await nc.jetstream(timeout=5.0).key_value(protocol.OBJECTS_BUCKET)
        await kv.put(key, protocol.encode(record))

    async def remove(nc: Client) -> None:
        kv = await nc.jetstream(timeout=5.0).key_value(protocol.OBJECTS_BUCKET)
        await kv.delete(key)

    async def read(nc: Client) -> list[protocol.ObjectStatus]:
        from oncall.get import read_records

        return await read_records(nc, protocol.OBJECTS_BUCKET, protocol.ObjectStatus)

    async def delete_marker(nc: Client) -> None:
        await nc.publish(f"$KV.{protocol.OBJECTS_BUCKET}.{key}", b"", headers={"KV-Operation": "DEL"})
        await nc.flush()

    with server:
        await connect.run_client(options("autoscaler"), buckets)  # only the autoscaler creates the buckets
        await connect.run_client(options("operator"), write)
        assert await connect.run_client(options("oncall"), read) == [record]
        subject = f"$KV.{protocol.OBJECTS_BUCKET}.{key}"
        for work in (kv_put(protocol.OBJECTS_BUCKET, key), delete_marker):
            with pytest.raises(PermissionDenied) as refused:
                await connect.run_client(options("oncall"), work)
            assert (refused.value.operation, refused.value.subject) == ("publish", subject)
        assert await connect.run_client(options("oncall"), read) == [record]
        await connect.run_client(options("operator"), remove)
        assert await connect.run_client(options("oncall"), read) == []
