"""The on-call CLI verbs, run through the `pulsescale` dispatcher against a real nats-server and a running
`CommandService`; the controller behind it is the in-memory double of test_commands."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from autoscaler.commands.service import CommandService
from oncall import client as oncall
from oncall import verbs
from oncall.apply import apply
from oncall.describe import describe
from oncall.get import get
from pulsescale import cli as dispatcher
from tests.autoscaler.test_commands import ControlPlaneDouble, make_spec, serving
from warmpool import cli as warmpool_cli
from warmpool import connect as nats_connect
from warmpool import durations, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.output import replicas_text
from warmpool.protocol import AuditRecord, DecisionRow, Override, ReplicaRecord, SlotRecord, StatusRow
from warmpool.registry import KvSlotStore
from warmpool.seed import seed_pool


@pytest.fixture
def control() -> ControlPlaneDouble:
    return ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8), "llama": make_spec("llama", 0, 4)})


@pytest.fixture
async def service(nc: Client, store: KvSlotStore, control: ControlPlaneDouble) -> AsyncIterator[CommandService]:
    await seed_pool(store, "qwen", nodes=2, slots_per_node=2)
    async with serving(nc, control, store) as svc:
        yield svc


Run = Callable[..., "asyncio.Future[tuple[int, str, str]]"]


@pytest.fixture
def cli(nats_server: NatsServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Run `pulsescale VERB ARGS` in a thread (it runs its own event loop) while the service answers in the
    test's loop. Returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("PULSESCALE_USER", "oncall-bob")

    async def run(verb: str, *args: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(dispatcher.main, [verb, *args, "--nats", nats_server.url])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


# --- --for ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("10m", 600),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1h30m15s", 5415),
        ("45m30s", 2730),
        (" 5m ", 300),
        ("500ms", 0.5),
        ("1.5h", 5400),
        ("600", 600),
        ("0.25", 0.25),
        ("1m500ms", 60.5),
    ],
)
def test_durations_parse(text: str, seconds: float) -> None:
    assert oncall.parse_duration(text) == seconds
    assert durations.parse_duration(text) == seconds  # one parser: the agent and the gateway read the same


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "not a duration such as 500ms, 90s, 2m, 1.5h, 1h30m or plain seconds (600)"),
        ("30m1h", "not a duration"),
        ("10min", "not a duration"),
        ("1h 30m", "not a duration"),
        ("-5m", "cannot be negative"),
        ("1d", "days are not a unit: write 24h"),
        ("0s", "no time at all"),
        ("0h0m", "no time at all"),
        ("0", "no time at all"),
        ("0.0001ms", "rounds to 0ms, no time at all; the shortest duration is 1ms"),
        ("0.0004", "rounds to 0ms"),
    ],
)
def test_bad_durations_are_refused_clearly(text: str, says: str) -> None:
    with pytest.raises(durations.DurationError, match=re.escape(says)):
        oncall.parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"), [(90, "1m30s"), (600, "10m"), (5400, "1h30m"), (45, "45s"), (0, "0s"), (0.5, "500ms")]
)
def test_durations_format(seconds: float, text: str) -> None:
    assert oncall.format_duration(seconds) == text
    assert durations.parse_duration(text, allow_zero=True) == seconds


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (-5, "<invalid>"),
        (0, "0s"),
        (119, "119s"),
        (130, "2m10s"),
        (300, "5m"),
        (600, "10m"),
        (179 * 60, "179m"),
        (3 * 3600 + 180, "3h3m"),
        (30 * 3600, "30h"),
        (3 * 86400 + 4 * 3600, "3d4h"),
        (3 * 86400, "3d"),
        (40 * 86400, "40d"),
        (3 * 365 * 86400, "3y"),
    ],
)
def test_ages_are_kubectls(seconds: float, shown: str) -> None:
    assert durations.age(seconds) == shown


def test_rfc3339_is_utc_with_z() -> None:
    assert durations.rfc3339(1_796_283_665.9) == "2026-12-03T07:41:05Z"
    assert durations.rfc3339(None) is None


def test_timeout_takes_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        verbs.status(["--timeout", "5min"], "pulsescale status")
    assert "argument --timeout: '5min' is not a duration such as 500ms" in capsys.readouterr().err


def test_timeout_over_a_requests_lifetime_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """The autoscaler refuses a request that expires over an hour ahead (`too_late`, "check the sender's clock"):
    the parser says the real reason instead."""
    with pytest.raises(SystemExit) as exc:
        verbs.scale(["qwen", "--replicas", "3", "--timeout", "2h"], "pulsescale scale")
    assert exc.value.code == 2
    assert "argument --timeout: '2h' is longer than a request may live (1h" in capsys.readouterr().err
    assert oncall.parser("p", "d").parse_args(["--timeout", "1h"]).timeout == 3600


def test_help_says_the_time_rule_and_get_hides_by(capsys: pytest.CaptureFixture[str]) -> None:
    for verb in (verbs.status, verbs.scale, verbs.pool):
        with pytest.raises(SystemExit):
            verb(["--help"], "pulsescale x")
        assert "times are Unix seconds" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        warmpool_cli.slots(["--help"], "pulsescale slots")
    assert "times are Unix seconds" in " ".join(capsys.readouterr().out.split())
    for verb in (get, describe):
        with pytest.raises(SystemExit):
            verb(["--help"], "pulsescale x")
        text = capsys.readouterr().out
        assert "--by" not in text and "audit" not in text
    with pytest.raises(SystemExit):
        verbs.scale(["--help"], "pulsescale scale")
    assert "--by" in capsys.readouterr().out


def test_bad_for_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        verbs.scale(["qwen", "--replicas", "3", "--for", "10min"], "pulsescale scale")
    assert exc.value.code == 2
    assert "argument --for: '10min' is not a duration such as 500ms, 90s, 2m, 1.5h" in capsys.readouterr().err


def test_bad_model_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        verbs.pause(["Qwen.7B"], "pulsescale pause")
    assert "'Qwen.7B' is not a model name" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "argv", "flag"),
    [
        (verbs.scale, ["qwen", "--replicas", "\u0663"], "--replicas"),  # ARABIC-INDIC DIGIT THREE
        (verbs.scale, ["qwen", "--replicas", "\uff13"], "--replicas"),  # FULLWIDTH DIGIT THREE
        (verbs.pause, ["qwen", "--replicas", "\u0663"], "--replicas"),
        (apply, ["-f", "x.yaml", "--max-replicas", "\u0663"], "--max-replicas"),
        (apply, ["-f", "x.yaml", "--max-replicas", "+3"], "--max-replicas"),
        (verbs.scale, ["qwen", "--replicas", "3", "--for", "\u0663m"], "--for"),
        (verbs.scale, ["qwen", "--replicas", "3", "--for", "\u0663"], "--for"),
    ],
)
def test_counts_and_durations_are_ascii_digits_only(
    command: Callable[[list[str], str], int], argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`str.isdigit` and `float` read other scripts' digits ("\u0663" as 3): a count that looks right in one
    terminal and is not what another shows. Go's strconv, kubectl and KEDA read ASCII digits only."""
    with pytest.raises(SystemExit) as exc:
        command(argv, "pulsescale x")
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_ascii_counts_are_still_read() -> None:
    assert oncall.replicas_arg("0") == 0 and oncall.replicas_arg("12") == 12
    assert oncall.positive_int_arg("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
        oncall.positive_int_arg("0")
    assert durations.parse_duration("1h30m") == 5400


# --- round trips ----------------------------------------------------------------------------------------------


async def test_scale_round_trip(cli, service: CommandService, control: ControlPlaneDouble, nc: Client) -> None:  # type: ignore[no-untyped-def]
    code, out, err = await cli("scale", "qwen", "--replicas", "4", "--for", "10m")
    assert (code, err) == (0, "")
    assert out.startswith("qwen held at 4 replicas until ") and out.rstrip().endswith("(10m) by oncall-bob")
    [(model, override)] = control.calls
    assert model == "qwen" and override is not None and override.replicas == 4 and override.by == "oncall-bob"


async def test_pause_resume_round_trip(cli, service: CommandService, control: ControlPlaneDouble) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = await cli("pause", "qwen", "--replicas", "2", "--by", "carol")
    assert code == 0 and out == "qwen paused at 2 replicas; `pulsescale resume qwen` hands it back to the policy\n"
    code, out, _ = await cli("pause", "llama")
    assert code == 0 and "llama paused at its current count" in out
    code, out, _ = await cli("resume", "qwen")
    assert code == 0 and out == "qwen is autoscaled again\n"
    assert control.calls == [
        ("qwen", Override(kind="pause", replicas=2, expires_at=None, by="carol")),
        ("llama", Override(kind="pause", replicas=None, expires_at=None, by="oncall-bob")),
        ("qwen", None),
    ]


async def test_one_replica_is_singular(cli, service: CommandService, control: ControlPlaneDouble) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = await cli("scale", "qwen", "--replicas", "1", "--for", "10m")
    assert code == 0 and out.startswith("qwen held at 1 replica until ")
    code, out, _ = await cli("pause", "llama", "--replicas", "1")
    assert code == 0 and out == "llama paused at 1 replica; `pulsescale resume llama` hands it back to the policy\n"
    control.specs["qwen"] = make_spec("qwen", 2, 8)
    code, _, err = await cli("scale", "qwen", "--replicas", "1")
    assert code == oncall.EXIT_REFUSED
    assert err.startswith("pulsescale scale: out_of_bounds: scale qwen to 1 replica is outside its ScaledObject's")
    assert [replicas_text(n) for n in (0, 1, 2)] == ["0 replicas", "1 replica", "2 replicas"]


async def test_refusals_print_code_and_message(cli, service: CommandService, control: ControlPlaneDouble) -> None:  # type: ignore[no-untyped-def]
    code, out, err = await cli("scale", "mistral", "--replicas", "2")
    assert code == oncall.EXIT_REFUSED and out == ""
    assert err == (
        "pulsescale scale: unknown_model: no ScaledObject names model 'mistral'; known models: llama, qwen\n"
    )
    code, _, err = await cli("scale", "qwen", "--replicas", "20")
    assert code == 1
    assert err.startswith("pulsescale scale: out_of_bounds: scale qwen to 20 replicas is outside")
    assert "[1, 8]" in err
    code, _, err = await cli("drain", "node-7")
    assert code == 1 and err.startswith("pulsescale drain: unknown_node: no agent or slot on node 'node-7'")
    assert control.calls == []


async def test_status_table_and_json(cli, service: CommandService, control: ControlPlaneDouble) -> None:  # type: ignore[no-untyped-def]
    assert (await cli("scale", "qwen", "--replicas", "3", "--for", "1h30m"))[0] == 0
    code, out, _ = await cli("status")
    assert code == 0
    lines = out.splitlines()
    header = ["MODEL", "DESIRED", "READY", "ACTIVATING", "WARM", "STALE", "MODE", "OVERRIDE", "LAST-REASON"]
    assert lines[0].split() == header
    assert lines[1].split()[:7] == ["llama", "0", "0", "0", "2", "1", "stable"]
    assert lines[2].split()[:7] == ["qwen", "3", "3", "0", "2", "1", "override"]
    assert "scale 3, 1h29m" in lines[2] or "scale 3, 1h30m" in lines[2]
    assert lines[2].endswith("by oncall-bob  demand 3.0 / target 4 per replica")
    # Columns line up: every row's MODE starts where the header's does.
    col = lines[0].index(" MODE ") + 1
    assert lines[1][col:].startswith("stable") and lines[2][col:].startswith("override")
    code, out, _ = await cli("status", "qwen", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["model"] for r in rows] == ["qwen"] and rows[0]["override"]["kind"] == "scale"
    assert (rows[0]["warm"], rows[0]["stale"]) == (2, 1)


async def test_pool_groups_slots_by_model(cli, service: CommandService) -> None:  # type: ignore[no-untyped-def]
    assert (await cli("drain", "node-1"))[0] == 0
    code, out, _ = await cli("pool")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "qwen: 4 slot(s): draining 2, warm 2"
    assert lines[1].split() == ["SLOT", "STATE", "NODE", "RACK", "AGENT", "RESIDENT", "ENDPOINT", "REASON"]
    assert lines[2].split() == ["qwen.node-0.s0", "warm", "node-0", "rack-0", "fresh", "yes", "-"]
    assert lines[4].split() == ["qwen.node-1.s0", "draining", "node-1", "rack-0", "fresh", "yes", "-"]
    code, out, _ = await cli("pool", "qwen", "--json")
    assert code == 0 and json.loads(out)["counts"] == {"qwen": {"draining": 2, "warm": 2}}


async def test_pool_get_wide_and_describe_show_the_slots_rootfs(
    cli, service: CommandService, store: KvSlotStore
) -> None:  # type: ignore[no-untyped-def]
    """A slot whose agent mounted an EROFS rootfs (revision 4): the pool reply carries `rootfs_mounted` and
    `image_digest` as the slot record has them, and `get slots -o wide` and `describe slot` show them."""
    digest = "sha256:" + "0123456789abcdef" * 4
    key = "qwen.node-9.s0"
    await store.register(
        SlotRecord(
            model="qwen",
            node="node-9",
            slot="s0",
            state="warm",
            rack="rack-0",
            weights_resident=True,
            rootfs_mounted=True,
            image_digest=digest,
            updated_at=store.clock(),
        )
    )
    code, out, err = await cli("pool", "qwen", "--json")
    assert (code, err) == (0, "")
    slot = {s["key"]: s for s in json.loads(out)["slots"]}[key]
    assert (slot["rootfs_mounted"], slot["image_digest"]) == (True, digest)

    code, out, err = await cli("get", "slots", key, "-o", "wide")
    assert (code, err) == (0, "")
    header, cells = (line.split() for line in out.splitlines())
    assert header[7:] == ["RACK", "ENGINE", "ROOTFS", "IMAGE", "REASON"]
    assert dict(zip(header, cells, strict=True))["ROOTFS"] == "mounted"
    assert dict(zip(header, cells, strict=True))["IMAGE"] == "sha256:0123456789ab"  # the digest, shortened
    code, out, _ = await cli("get", "slots", "qwen.node-0.s0", "-o", "wide")  # seeded: mounted, no digest known
    header, cells = (line.split() for line in out.splitlines())
    assert code == 0 and cells[header.index("ROOTFS") :][:2] == ["mounted", "-"]

    code, out, err = await cli("describe", "slot", key)
    assert (code, err) == (0, "")
    lines = [line.split() for line in out.splitlines()]
    assert ["Rootfs", "mounted:", "True"] in lines
    assert ["Image", "digest:", digest] in lines


async def test_drain_undrain_round_trip(cli, service: CommandService, store: KvSlotStore) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = await cli("drain", "node-0")
    assert code == 0 and out == "node-0 drained: 2 slot(s) changed\n  qwen.node-0.s0\n  qwen.node-0.s1\n"
    code, out, _ = await cli("undrain", "node-0")
    assert code == 0 and out.startswith("node-0 undrained: 2 slot(s) changed")
    code, _, _ = await cli("undrain", "node-0")  # a repeat is harmless
    assert code == 0
    assert {r.state for r in store.records("qwen")} == {"warm"}


async def test_every_cli_command_is_audited(cli, service: CommandService, nc: Client) -> None:  # type: ignore[no-untyped-def]
    from tests.autoscaler.test_commands import audit_records

    for verb, *args in (["scale", "qwen", "--replicas", "2"], ["status"], ["pool"], ["resume", "mistral"]):
        await cli(verb, *args)
    records: list[AuditRecord] = await audit_records(nc)
    assert [(r.verb, r.applied, r.by) for r in records] == [
        ("scale", True, "oncall-bob"),
        ("status", True, "oncall-bob"),
        ("pool", True, "oncall-bob"),
        ("resume", False, "oncall-bob"),
    ]


# --- nobody answering -----------------------------------------------------------------------------------------


async def test_no_autoscaler_is_no_responders_not_a_timeout(cli, nc: Client) -> None:  # type: ignore[no-untyped-def]
    code, out, err = await cli("scale", "qwen", "--replicas", "2", "--timeout", "3")
    assert code == oncall.EXIT_NO_RESPONDERS == 3 and out == ""
    assert err == (
        "pulsescale scale: no autoscaler is answering on pulse.cmd.scale (is `pulsescale autoscaler` running and "
        "connected to the same NATS? any replica that holds a shard answers and hands the command to the model's "
        "owner; while none holds one, as during a failover, retry in a few seconds)\n"
    )


async def test_a_silent_autoscaler_is_a_timeout(cli, nc: Client) -> None:  # type: ignore[no-untyped-def]
    seen: list[Msg] = []

    async def swallow(msg: Msg) -> None:
        seen.append(msg)

    sub = await nc.subscribe("pulse.cmd.*", cb=swallow)
    await nc.flush()
    before = time.time()
    try:
        code, _, err = await cli("status", "--timeout", "0.3")
    finally:
        await sub.unsubscribe()
    after = time.time()
    assert code == oncall.EXIT_TIMEOUT == 4
    assert "did not answer on pulse.cmd.status within 0.3 s" in err and "pulsescale status" in err
    # The request expires when the CLI gives up, so it cannot be applied late.
    body = json.loads(seen[0].data)
    assert body["by"] == "oncall-bob" and len(body["id"]) == 32
    assert before + 0.3 <= body["expires_at"] <= after


async def test_unreachable_nats_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["status", "--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "0.5"]
    code = await asyncio.to_thread(dispatcher.main, argv)
    err = capsys.readouterr().err
    assert code == 3 and err.startswith("pulsescale status: cannot connect to NATS") and err.count("\n") == 1


# --- formatting (no NATS) -------------------------------------------------------------------------------------


def row(model: str, **fields: Any) -> StatusRow:
    counts = {"desired": 1, "ready": 1, "activating": 0, "warm": 0}
    return StatusRow(model=model, scaler=f"default.{model}", **{**counts, **fields})


def test_status_table_formatting() -> None:
    now = 1_700_000_000.0
    rows = [
        row(
            "qwen",
            desired=6,
            ready=4,
            activating=2,
            warm=1,
            stale=2,
            panic=True,
            mode="panic",
            reason="panic: demand 30 >= 2.0 x capacity 12",
        ),
        row(
            "llama-3-70b",
            desired=2,
            ready=2,
            warm=3,
            mode="stable",
            override=Override(kind="pause", replicas=2, by="alice"),
        ),
        row(
            "m",
            panic=True,
            mode="stable",
            override=Override(kind="scale", replicas=1, expires_at=now + 552, by="bob"),
            reason="override",
        ),
    ]
    assert verbs.format_status(rows, now).splitlines() == [
        "MODEL        DESIRED  READY  ACTIVATING  WARM  STALE  MODE          OVERRIDE                    LAST-REASON",
        "qwen         6        4      2           1     2      panic         -                           "
        "panic: demand 30 >= 2.0 x capacity 12",
        "llama-3-70b  2        2      0           3     0      stable        pause 2 by alice            -",
        "m            1        1      0           0     0      stable,panic  scale 1, 9m12s left by bob  override",
    ]


def test_status_of_one_model_shows_its_decisions() -> None:
    decisions = [DecisionRow(ts=0.0, desired=2, reason="r1"), DecisionRow(ts=60.0, desired=3, reason="r2")]
    qwen = row("qwen", desired=3, ready=3, warm=2, mode="stable", reason="r2", decisions=decisions)
    lines = verbs.format_status([qwen], 100.0).splitlines()
    assert lines[3] == "recent decisions of qwen (newest last):"
    # RFC 3339 (UTC) with the age, not a clock time without a date.
    assert lines[4] == "  1970-01-01T00:00:00Z (100s ago)  desired 2     r1"
    assert lines[5] == "  1970-01-01T00:01:00Z (40s ago)  desired 3     r2"
    assert verbs.format_status([], 0.0).splitlines()[1].startswith("(no models: apply a ScaledObject")


def test_default_by() -> None:
    assert oncall.default_by({"PULSESCALE_USER": "pager"}) == "pager"
    assert "@" in oncall.default_by({})


# --- several autoscaler replicas (protocol revision 6) ------------------------------------------------------------


def replica(identity: str, shards: list[int], models: int, age_s: float, now: float) -> ReplicaRecord:
    return ReplicaRecord(
        identity=identity, renewed_at=now, lease_s=5.0, started_at=now - age_s, shards=shards, models=models
    )


def test_status_shows_the_owner_and_the_replicas() -> None:
    now = 1_700_000_000.0
    rows = [row("llama", owner="a", shard=3, mode="stable"), row("qwen", owner="b", shard=17, mode="stable")]
    replicas = [replica("a", [*range(0, 11), 12], 1, 330, now), replica("b", [11, *range(13, 32)], 1, 90, now)]
    assert verbs.format_status(rows, now, replicas=replicas).splitlines() == [
        "MODEL  OWNER  DESIRED  READY  ACTIVATING  WARM  STALE  MODE    OVERRIDE  LAST-REASON",
        "llama  a      1        1      0           0     0      stable  -         -",
        "qwen   b      1        1      0           0     0      stable  -         -",
        "",
        "replicas: 2",
        "  REPLICA  SHARDS         MODELS  AGE",
        "  a        0-10,12 (12)   1       5m30s",
        "  b        11,13-31 (20)  1       90s",
    ]
    wide = verbs.format_status(rows, now, replicas=replicas, wide=True).splitlines()
    assert wide[0].split()[:4] == ["MODEL", "OWNER", "SHARD", "DESIRED"]
    assert wide[2].split()[:4] == ["qwen", "b", "17", "1"]


def test_status_with_one_replica_says_so_on_one_line() -> None:
    now = 1_700_000_000.0
    lines = verbs.format_status(
        [row("qwen", owner="a", shard=17)], now, replicas=[replica("a", list(range(32)), 1, 7200, now)]
    )
    assert lines.splitlines()[0].split()[:2] == ["MODEL", "DESIRED"]  # no OWNER column: nothing to tell apart
    assert lines.splitlines()[-2:] == ["", "1 replica: a, shards 0-31 (32), 1 model(s), up 120m"]


async def test_status_cli_over_two_replicas(cli, nats_server: NatsServer, store: KvSlotStore) -> None:  # type: ignore[no-untyped-def]
    """The real command against two routing replicas: OWNER per model, the replicas section, -o json with both."""
    from tests.autoscaler.test_commands_routing import (
        FixedRouter,  # a fixture class: the owner map in place of shard leases
    )

    owners: dict[str, str | None] = {"qwen": "b", "llama": "a"}
    services, conns = [], []
    try:
        for ident in ("a", "b"):
            conn = await nats_connect.connect(nats_connect.NatsOptions(servers=(nats_server.url,), name=ident))
            conns.append(conn)
            control = ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8), "llama": make_spec("llama", 0, 4)})
            svc = CommandService(conn, control, store, router=FixedRouter(ident, dict(owners), ["a", "b"]))
            await svc.start()
            services.append(svc)
        code, out, err = await cli("status")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:3] == ["MODEL", "OWNER", "DESIRED"]
        assert [line.split()[:2] for line in lines[1:3]] == [["llama", "a"], ["qwen", "b"]]
        assert lines[4] == "replicas: 2" and lines[6].split()[0] == "a" and lines[7].split()[0] == "b"
        code, out, _ = await cli("status", "-o", "wide")
        assert code == 0 and out.splitlines()[2].split()[:3] == ["qwen", "b", str(protocol.shard_of("qwen"))]
        code, out, _ = await cli("status", "--json")
        data = json.loads(out)
        assert [(m["model"], m["owner"]) for m in data] == [("llama", "a"), ("qwen", "b")]  # one shape always
        code, out, _ = await cli("scale", "qwen", "--replicas", "2")  # handed to b whichever replica took it
        assert code == 0 and out.startswith("qwen held at 2 replicas")
    finally:
        for svc in services:
            await svc.stop()
        for conn in conns:
            await conn.close()


async def test_status_cli_warns_of_a_silent_replica_and_shows_the_rest(  # type: ignore[no-untyped-def]
    cli, nc: Client, nats_server: NatsServer, store: KvSlotStore
) -> None:
    from autoscaler.commands.service import CommandSettings
    from tests.autoscaler.test_commands_routing import FixedRouter

    hung = await nc.subscribe(protocol.replica_subject("d", "*"))  # replica d takes requests and answers none
    await nc.flush()
    conn = await nats_connect.connect(nats_connect.NatsOptions(servers=(nats_server.url,), name="a"))
    control = ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8), "llama": make_spec("llama", 0, 4)})
    router = FixedRouter("a", {"qwen": "a", "llama": "d"}, ["a", "d"])
    svc = CommandService(conn, control, store, router=router, settings=CommandSettings(peer_status_timeout_s=0.3))
    try:
        await svc.start()
        code, out, err = await cli("status")
        assert code == 0
        assert err == (
            "pulsescale status: warning: autoscaler replica(s) d did not answer in time: their models are "
            "missing; retry\n"
        )
        assert [line.split()[:2] for line in out.splitlines()[1:2]] == [["qwen", "a"]]
        code, out, err = await cli("status", "-o", "json")
        assert code == 0 and "warning" in err and [m["model"] for m in json.loads(out)] == ["qwen"]
    finally:
        await svc.stop()
        await conn.close()
        await hung.unsubscribe()
