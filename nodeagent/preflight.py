"""`pulsescale agent --check`: is this node ready for the agent configuration given, before a launch-day spike?

Takes the same flags as a real run and checks what the agent would run into, one line per check::

    OK   privileges   root (uid 0): locks weights, mounts images, drops engines to --engine-user
    WARN engine-user  nobody (uid 65534): shared with other daemons, which could signal an engine; fix: ...
    FAIL nats         cannot connect to NATS at nats://10.0.0.5:4222: ...; fix: ...
    check: 12 OK, 1 WARN, 1 FAIL: not ready, fix the FAIL lines first

OK is ready; WARN runs, degraded or less safe (the agent would say so in its log); FAIL is what stops the agent
or fails its slots. Exit 0 with no FAIL, 1 with any.

Read-only and short-lived: nothing is made or changed (the staging directory's walk runs with ``create=False``,
the rootfs probe loads no module), NATS is connected to, flushed and asked whether the buckets exist, never
written to; no engine, zygote or server is started. What runs as the engine user (is its command executable, can it
read the model, does vLLM import) runs in a forked child that drops to that user the way engines do
(`zygote.drop_privileges`, `served`'s pre-exec step): the checking process never changes its own identity.

Every check calls the agent's own code, so the check and the run cannot disagree: the flags through the CLI's own
validation, staging's directory walk, source, budget and shm accounting, `forked.engine_identity`,
`served.render`, `vllm.server_spec`, `rootfs.probe`, `loaders.choose`/`probe_gpu` and `cudaplan.pin_decision`,
`warmpool.connect`.

The checks live beside this module, which runs them in order and prints the report: `preflight_host` (privileges,
model, shm-dir, shm-space, shm-budget, memlock), `preflight_engine` (engine-user, engine-exec, engine-ports, vllm,
loader, rootfs), and here the flags, NATS and metrics; the terms they share (`Check`, `summary`, `Node`) are in
`preflight_base`. Every check function is importable from here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Final, NoReturn

from nodeagent.preflight_base import ALL_INTERFACES, Check, Node, Status, port_free, summary
from nodeagent.preflight_engine import (
    IMPORT_TIMEOUT_S,
    PRIVILEGED_PORTS,
    check_engine_exec,
    check_engine_ports,
    check_engine_user,
    check_loader,
    check_rootfs,
    check_vllm,
)
from nodeagent.preflight_host import (
    SOURCE_TIMEOUT_S,
    check_budget,
    check_memlock,
    check_model,
    check_privileges,
    check_shm_dir,
    check_shm_space,
)
from warmpool import connect as nats_connect
from warmpool import protocol
from warmpool.errors import PulsescaleError

__all__ = [
    "IMPORT_TIMEOUT_S",
    "NATS_TIMEOUT_S",
    "PRIVILEGED_PORTS",
    "SOURCE_TIMEOUT_S",
    "Check",
    "FlagsRefused",
    "RefusingParser",
    "Status",
    "check_budget",
    "check_engine_exec",
    "check_engine_ports",
    "check_engine_user",
    "check_flags",
    "check_loader",
    "check_memlock",
    "check_metrics",
    "check_model",
    "check_nats",
    "check_privileges",
    "check_rootfs",
    "check_shm_dir",
    "check_shm_space",
    "check_vllm",
    "iter_checks",
    "main",
    "summary",
]

NATS_TIMEOUT_S: Final = 2.0
"""Connect, then flush, each within this: a broker that takes longer to answer a node is not ready for a pulse."""


class FlagsRefused(Exception):
    """The agent's own flag validation refused the command line (what `argparse` would exit 2 with)."""


class RefusingParser(argparse.ArgumentParser):
    """A parser whose `error` raises `FlagsRefused` instead of exiting: the CLI's `_settings` runs with it, so
    the check reports what a real start would refuse and goes on with the other checks."""

    def error(self, message: str) -> NoReturn:
        raise FlagsRefused(message)


def check_flags(validate: Callable[[], object]) -> Check:
    try:
        validate()
    except (FlagsRefused, PulsescaleError) as err:
        return Check("flags", "FAIL", f"a real start refuses them: {err}", "change the flag the message names")
    return Check("flags", "OK", "a real start accepts them")


async def check_nats(opts: nats_connect.NatsOptions, timeout_s: float = NATS_TIMEOUT_S) -> list[Check]:
    """Connect and flush within `timeout_s` each, then look the registry's buckets up. Read-only."""
    import nats.errors
    import nats.js.errors

    t0 = time.perf_counter()
    try:
        nc = await nats_connect.connect(replace(opts, connect_deadline_s=timeout_s))
    except PulsescaleError as err:
        return [
            Check(
                "nats",
                "FAIL",
                f"{err} (after {time.perf_counter() - t0:.1f} s)",
                "start NATS or fix --nats and the credentials",
            )
        ]
    try:
        try:
            await nc.flush(timeout=max(1, round(timeout_s)))  # whole seconds in nats-py
        except (nats.errors.Error, TimeoutError) as err:
            return [Check("nats", "FAIL", f"connected, but no flush within {timeout_s:g} s: {err!r}", "")]
        where = nc.connected_url.netloc if nc.connected_url else ",".join(opts.servers)
        user = f" as {opts.user}" if opts.user else ""
        out = [
            Check("nats", "OK", f"{where}{user}: connected and flushed in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        ]
        js = nc.jetstream(timeout=timeout_s)
        missing = []
        for bucket in (protocol.SLOTS_BUCKET, protocol.AGENTS_BUCKET):
            try:
                await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                missing.append(bucket)
            except nats.errors.NoRespondersError:
                out.append(Check("buckets", "FAIL", "no JetStream on this server", "run nats-server with -js"))
                return out
            except (nats.errors.Error, TimeoutError) as err:
                denied = nats_connect.permission_denied(err)
                text = str(denied) if denied is not None else f"{type(err).__name__}: {err}"
                out.append(Check("buckets", "FAIL", f"cannot look up {bucket}: {text}", "check the agent's NATS user"))
                return out
        if missing:
            out.append(
                Check(
                    "buckets",
                    "WARN",
                    f"{', '.join(missing)} missing",
                    "start the autoscaler first: it creates them (an agent whose user may not create buckets exits 1)",
                )
            )
        else:
            out.append(Check("buckets", "OK", f"{protocol.SLOTS_BUCKET} and {protocol.AGENTS_BUCKET} exist"))
        return out
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def check_metrics(node: Node) -> Check:
    a = node.args
    if a.metrics_port < 0:
        return Check("metrics", "OK", "off (--metrics-port -1)")
    where = f"{a.metrics_host}:{a.metrics_port or 'any free port'}"
    if a.metrics_port and not port_free(a.metrics_host, a.metrics_port):
        # A FAIL, not a WARN: the agent exits 1 at start when it cannot bind it.
        return Check(
            "metrics",
            "FAIL",
            f"{where} in use now (an agent already running here?): a start would exit 1",
            "another --metrics-port (0 = any free), or stop what holds it",
        )
    if a.metrics_host in ALL_INTERFACES:
        return Check(
            "metrics",
            "WARN",
            f"{where}: /metrics and /status, unauthenticated, on every interface",
            "--metrics-host <pod IP> (Kubernetes: the downward API's status.podIP) or 127.0.0.1",
        )
    return Check("metrics", "OK", where)


def iter_checks(args: argparse.Namespace, validate: Callable[[], object]) -> Iterator[Check]:
    """Every check for the agent command line `args` (parsed by the agent's parser), in the order a reader fixes
    them; `validate()` is the CLI's own flag validation (raises `FlagsRefused`). Later checks use what earlier
    ones measured (the model's size, the engine user)."""
    node = Node.from_args(args)
    yield check_flags(validate)
    yield check_privileges()
    yield check_model(node)
    dir_check, use = check_shm_dir(node)
    yield dir_check
    yield check_shm_space(node, use)
    yield check_budget(node, use)
    yield check_engine_user(node)
    yield check_memlock(node)
    yield check_engine_exec(node)
    yield check_engine_ports(node)
    if (v := check_vllm(node)) is not None:
        yield v
    yield check_loader(node)
    yield check_rootfs(node)
    try:
        opts = nats_connect.options_from_args(args, name=f"pulsescale-agent-check-{args.node or 'node'}")
    except PulsescaleError as err:
        yield Check("nats", "FAIL", str(err), "fix the NATS flags")
    else:
        yield from asyncio.run(check_nats(opts))
    yield check_metrics(node)


def main(args: argparse.Namespace, validate: Callable[[], object]) -> int:
    """`pulsescale agent --check ...`: print each check as it completes, then the summary; 0 when nothing
    FAILed, else 1."""
    checks = []
    for c in iter_checks(args, validate):
        checks.append(c)
        print(c.line(), flush=True)
    text, code = summary(checks)
    print(text, flush=True)
    return code
