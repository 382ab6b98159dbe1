"""Wire contract v1: every rule of DESIGN.md, each malformed class with its named reason."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from warmpool import protocol
from warmpool.errors import BadMessage, DuplicateRequest
from warmpool.ledger import RequestLedger, admit
from warmpool.protocol import ActivateRequest, QueueSample, ScaleCommand, SlotRecord
from warmpool.rejects import Rejections

GOOD_SAMPLE = {
    "v": 1,
    "gateway": "gw-1",
    "model": "qwen2-7b",
    "seq": 7,
    "ts": 1700000000.25,
    "queue_depth": 3,
    "inflight": 2,
    "arrivals_total": 100,
    "completions_total": 95,
    "timeouts_total": 0,
}


def sample(**changes: object) -> bytes:
    d = {**GOOD_SAMPLE, **changes}
    for k, v in list(d.items()):
        if v is ...:
            del d[k]
    return json.dumps(d).encode()


def test_good_sample_round_trips() -> None:
    msg = protocol.decode(sample(), QueueSample)
    assert msg.model == "qwen2-7b" and msg.seq == 7 and msg.queue_depth == 3
    assert protocol.decode(protocol.encode(msg), QueueSample) == msg


def test_unknown_fields_are_ignored() -> None:
    assert protocol.decode(sample(region="eu", extra={"a": 1}), QueueSample).inflight == 2


BAD = [
    ("bad_json", b"{not json"),
    ("bad_json", b"\xff\xfe"),
    ("not_object", b"[1, 2, 3]"),
    ("not_object", b'"hello"'),
    ("bad_version", sample(v=2)),
    ("bad_version", sample(v=...)),
    ("bad_version", sample(v="1")),
    ("missing_field", sample(queue_depth=...)),
    ("wrong_type", sample(queue_depth="3")),
    ("wrong_type", sample(inflight=2.5)),
    ("wrong_type", sample(ts=True)),
    ("non_finite", sample(ts=math.nan)),  # json.dumps writes NaN, as a careless gateway would
    ("non_finite", sample(ts=math.inf)),
    (
        "non_finite",
        b'{"v":1,"gateway":"g","model":"m","seq":1,"ts":1e999,"queue_depth":0,"inflight":0,'
        b'"arrivals_total":0,"completions_total":0,"timeouts_total":0}',
    ),
    ("negative", sample(queue_depth=-1)),
    ("negative", sample(arrivals_total=-5)),
    ("negative", sample(seq=-1)),
    ("negative", sample(ts=-1.0)),
    ("bad_name", sample(model="Qwen2")),
    ("bad_name", sample(model="qwen.2")),
    ("bad_name", sample(model="-qwen")),
    ("bad_name", sample(model="a" * 64)),
    ("wrong_type", sample(gateway=5)),
    ("too_large", sample(padding="x" * (64 * 1024))),
]


@pytest.mark.parametrize(("reason", "data"), BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD)])
def test_malformed_sample_gets_its_reason(reason: str, data: bytes) -> None:
    with pytest.raises(BadMessage) as info:
        protocol.decode(data, QueueSample)
    assert info.value.reason == reason, str(info.value)
    assert info.value.reason in protocol.REASONS


def test_every_reason_is_reachable_and_documented() -> None:
    covered = {r for r, _ in BAD} | {"expired", "duplicate_id", "bad_value", "subject_mismatch", "too_late"}
    covered |= {"clock_skew"}  # a lease's stamp against the reader's clock: tests/autoscaler/test_clock_skew.py
    covered |= {"unassigned_model"}  # a slot against its node's assignment: tests/warmpool/test_assignments.py
    covered |= {"bad_source"}  # a ScaledObject's source block, by the bridge: tests/bridge/test_scaledobjects.py
    assert covered == set(protocol.REASONS)


def test_names_follow_the_pattern() -> None:
    assert protocol.is_name("a") and protocol.is_name("qwen2-7b_x") and protocol.is_name("a" * 63)
    for bad in ("", "A", "a.b", "a b", "-a", "a-", "a" * 64, "a>b", "a*"):
        assert not protocol.is_name(bad), bad
    assert protocol.slot_key("m", "n", "s0") == "m.n.s0"
    assert protocol.parse_slot_key("m.n.s0") == ("m", "n", "s0")
    with pytest.raises(BadMessage, match="bad_name"):
        protocol.queue_subject("has.dot")
    with pytest.raises(BadMessage, match="bad_name"):
        protocol.parse_slot_key("m.n")
    with pytest.raises(BadMessage, match="bad_value"):
        protocol.cmd_subject("explode")
    assert protocol.agent_subject("node-1", "activate") == "pulse.agent.node-1.activate"


def test_commands_need_id_expiry_and_sender() -> None:
    ok = {"v": 1, "id": "r1", "expires_at": 100.0, "by": "alice", "model": "m", "replicas": 3, "for_s": 600}
    cmd = protocol.decode(json.dumps(ok).encode(), ScaleCommand)
    assert cmd.replicas == 3
    for field, reason in (("id", "missing_field"), ("expires_at", "missing_field"), ("by", "missing_field")):
        bad = {k: v for k, v in ok.items() if k != field}
        with pytest.raises(BadMessage) as info:
            protocol.decode(json.dumps(bad).encode(), ScaleCommand)
        assert info.value.reason == reason
    with pytest.raises(BadMessage) as info:
        protocol.decode(json.dumps({**ok, "for_s": 0}).encode(), ScaleCommand)
    assert info.value.reason == "bad_value"
    with pytest.raises(BadMessage) as info:
        protocol.decode(json.dumps({**ok, "id": ""}).encode(), ScaleCommand)
    assert info.value.reason == "bad_value"


def test_activate_token_must_be_positive() -> None:
    req = {"v": 1, "id": "a", "expires_at": 1.0, "slot": "s0", "token": 0, "claim_id": "c", "deadline": 2.0}
    with pytest.raises(BadMessage) as info:
        protocol.decode(json.dumps(req).encode(), ActivateRequest)
    assert info.value.reason == "negative"


def test_expired_and_duplicate_requests() -> None:
    ledger = RequestLedger()
    req = protocol.decode(
        b'{"v":1,"id":"r1","expires_at":100.0,"by":"bob","model":"m","replicas":1,"for_s":5}', ScaleCommand
    )
    admit(req, 99.0, ledger)  # fresh, first time: admitted
    ledger.record(req, protocol.ok_reply(applied=True), 99.0)
    with pytest.raises(DuplicateRequest) as dup:
        admit(req, 99.5, ledger)
    assert dup.value.reason == "duplicate_id"
    assert protocol.decode_reply(dup.value.reply).fields == {"applied": True}
    with pytest.raises(BadMessage) as info:
        admit(req, 100.5, ledger)
    assert info.value.reason == "expired"


def test_a_request_valid_for_longer_than_the_maximum_ttl_is_refused() -> None:
    """A forged or clock-broken sender cannot make a request replayable (and remembered) for years."""
    ledger = RequestLedger()
    now = 1_000.0
    far = protocol.ScaleCommand(
        id="r", expires_at=now + protocol.MAX_REQUEST_TTL_S + 1, by="b", model="m", replicas=1, for_s=5
    )
    with pytest.raises(BadMessage) as info:
        admit(far, now, ledger)
    assert info.value.reason == "too_late" and "check the sender's clock" in str(info.value)
    near = protocol.ScaleCommand(
        id="r", expires_at=now + protocol.MAX_REQUEST_TTL_S, by="b", model="m", replicas=1, for_s=5
    )
    admit(near, now, ledger)  # exactly the maximum: admitted


def test_a_future_dated_or_over_long_lease_is_not_fresh() -> None:
    """A fake node cannot stay claimable by dating its heartbeat ahead or by claiming a lease of hours."""
    now = 10_000.0
    honest = protocol.AgentLease(node="n", heartbeat_at=now - 1, lease_s=6)
    assert honest.fresh(now) and not honest.fresh(now + 6)
    skewed = protocol.AgentLease(node="n", heartbeat_at=now + protocol.MAX_CLOCK_SKEW_S, lease_s=6)
    assert skewed.fresh(now)  # within the allowed clock skew
    forged = protocol.AgentLease(node="n", heartbeat_at=now + protocol.MAX_CLOCK_SKEW_S + 0.5, lease_s=6)
    assert not forged.fresh(now)
    assert not protocol.AgentLease(node="n", heartbeat_at=now + 1e9, lease_s=6).fresh(now)
    with pytest.raises(BadMessage) as info:
        protocol.decode(b'{"v":1,"node":"n","heartbeat_at":10000,"lease_s":1e6}', protocol.AgentLease)
    assert info.value.reason == "bad_value" and "at most" in str(info.value)


def test_ledger_is_bounded() -> None:
    ledger = RequestLedger(max_entries=3)
    for i in range(10):
        req = protocol.decode(
            json.dumps({"v": 1, "id": f"r{i}", "expires_at": 1e12, "by": "b", "model": "m"}).encode(),
            protocol.ResumeCommand,
        )
        ledger.record(req, b"{}", 0.0)
    assert len(ledger) == 3 and ledger.seen("r9") is not None and ledger.seen("r0") is None


def test_replies() -> None:
    r = protocol.decode_reply(protocol.ok_reply(replicas=3))
    assert r.ok and r.fields == {"replicas": 3}
    r = protocol.decode_reply(protocol.error_reply("unknown_model", "no model x"))
    assert not r.ok and r.error is not None and r.error.code == "unknown_model"
    with pytest.raises(BadMessage):
        protocol.decode_reply(b'{"v":1}')


def test_encode_refuses_oversize() -> None:
    rec = SlotRecord(model="m", node="n", slot="s", state="failed", reason="x" * 4096)
    assert len(protocol.encode(rec)) < protocol.MAX_MESSAGE_BYTES
    lease = protocol.AgentLease(node="n", rack="r" * protocol.MAX_MESSAGE_BYTES, heartbeat_at=1.0, lease_s=1.0)
    with pytest.raises(BadMessage, match="too_large"):
        protocol.encode(lease)


@given(
    seq=st.integers(min_value=0, max_value=2**53),
    depth=st.integers(min_value=0, max_value=2**31),
    ts=st.floats(min_value=0, max_value=4e9, allow_nan=False),
)
def test_sample_round_trip_property(seq: int, depth: int, ts: float) -> None:
    msg = QueueSample(
        gateway="g",
        model="m",
        seq=seq,
        ts=ts,
        queue_depth=depth,
        inflight=0,
        arrivals_total=0,
        completions_total=0,
        timeouts_total=0,
    )
    assert protocol.decode(protocol.encode(msg), QueueSample) == msg


@given(st.binary(max_size=300))
def test_decode_never_raises_anything_but_bad_message(data: bytes) -> None:
    try:
        protocol.decode(data, QueueSample)
    except BadMessage as err:
        assert err.reason in protocol.REASONS


async def test_consumer_on_real_nats_keeps_going(nc: Client) -> None:
    """Bad messages between good ones: each counted by reason, every good one still consumed."""
    import logging

    rejections = Rejections(logging.getLogger("test"))
    good: list[QueueSample] = []
    done = asyncio.Event()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        try:
            s = protocol.decode(msg.data, QueueSample)
        except BadMessage as err:
            rejections(err, source=msg.subject)
            return
        good.append(s)
        if s.seq == 99:
            done.set()

    await nc.subscribe(protocol.QUEUE_WILDCARD, cb=on_msg)
    for _reason, data in BAD:
        await nc.publish(protocol.queue_subject("m"), data)
        await nc.publish(protocol.queue_subject("m"), sample(seq=len(good)))
    await nc.publish(protocol.queue_subject("m"), sample(seq=99))
    await asyncio.wait_for(done.wait(), 5)
    assert len(good) == len(BAD) + 1
    expected: dict[str, int] = {}
    for reason, _ in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(rejections.counts) == expected


def test_rejections_log_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    now = [0.0]
    rej = Rejections(logging.getLogger("rate"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rate"):
        for _ in range(1000):
            rej(BadMessage("negative", "x"), source="s")
        now[0] = 11.0
        rej(BadMessage("negative", "x"), source="s")
        rej(BadMessage("bad_json", "y"), source="s")
    assert rej.counts == {"negative": 1001, "bad_json": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "999 more negative" in lines[1]


def test_the_face_exports_every_name_of_its_parts() -> None:
    """`warmpool.protocol` is a package (issue 24): every name of `__all__` resolves on it, each part's public names
    are the face's own objects; the ledger is consumer state, not contract (`warmpool.ledger`)."""
    from warmpool.protocol import base, codec, messages, names, records, replies, scaledobject

    for name in protocol.__all__:
        assert hasattr(protocol, name), name
    for part in (names, base, messages, records, replies, scaledobject, codec):
        for name in part.__all__:
            assert getattr(protocol, name) is getattr(part, name), f"{part.__name__}.{name}"
    assert not hasattr(protocol, "RequestLedger") and not hasattr(protocol, "admit")


# --- revision 13: what a ScaledObject CR says (pulse_objects) --------------------------------------------------------


def _object_status(**changes: object) -> bytes:
    d: dict[str, object] = {
        "v": 1, "namespace": "inference", "name": "qwen.v2", "published": False,
        "conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "m", "since": 1.0}],
        "labels": {"team": "chat"}, "updated_at": 2.0, "a_later_field": True,
    }  # fmt: skip
    d.update(changes)
    return json.dumps(d).encode()


def test_an_object_status_names_a_kubernetes_object_and_bounds_what_it_carries() -> None:
    """A CR's name may have dots (a DNS subdomain; the namespace has none, so the key still splits); a condition
    type a newer operator adds still reads; reasons are metav1's words, messages and lists are bounded."""
    rec = protocol.decode(_object_status(), protocol.ObjectStatus)
    assert rec.key == "inference.qwen.v2" and rec.condition("Ready") is not None and rec.condition("Active") is None
    more = [{"type": "Ready", "status": "True"}, {"type": "Scaling", "status": "Unknown"}]
    assert len(protocol.decode(_object_status(conditions=more), protocol.ObjectStatus).conditions) == 2
    target = protocol.decode(_object_status(target="StatefulSet/db-0"), protocol.ObjectStatus).target
    assert target == "StatefulSet/db-0"
    bad = [
        ("bad_name", {"name": "Qwen"}),
        ("bad_value", {"name": "x" * 254}),
        ("bad_name", {"namespace": "a.b"}),
        ("bad_name", {"target": "qwen"}),
        ("bad_name", {"conditions": [{"type": "Ready", "status": "False", "reason": "not a word"}]}),
        ("bad_value", {"conditions": [{"type": "Ready", "status": "Maybe"}]}),
        ("bad_value", {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Ready", "status": "False"}]}),
        ("bad_value", {"conditions": [{"type": f"T{i}", "status": "True"} for i in range(9)]}),
        ("bad_value", {"conditions": [{"type": "Ready", "status": "True", "message": "x" * 4097}]}),
        ("bad_value", {"labels": {f"k{i}": "v" for i in range(protocol.MAX_LABELS + 1)}}),
        ("negative", {"min_replicas": -1}),
    ]
    for reason, change in bad:
        with pytest.raises(BadMessage) as err:
            protocol.decode(_object_status(**change), protocol.ObjectStatus)
        assert err.value.reason == reason, (change, err.value)
    assert protocol.OBJECTS_BUCKET in protocol.BUCKETS and protocol.CONTRACT_REVISION >= 13
