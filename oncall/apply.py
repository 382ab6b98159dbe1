"""`pulsescale apply -f`: ScaledObjects from YAML files to KV `pulse_scalers`, for use without Kubernetes.

Every document of every ``-f`` (files, directories, ``-`` for stdin) is checked before any is written
(`load_manifests`; `pulsescale delete -f` reads the same files), then each record is written with its generation
bumped, or left as it is when its content is unchanged. Writing the bucket needs the operator's NATS user.
``--dry-run`` checks the files, and whether another ScaledObject already scales their models when NATS answers
within `DRY_RUN_CONNECT_S`. Exit codes: 0 done; 1 a file or a write refused (`client.EXIT_REFUSED`); 2 usage.

On Kubernetes the operator publishes the ScaledObject CRs under the same keys: a record it published
(`protocol.ScalerRecord.managed_by`, contract revision 14) is not replaced (`PublishedByOperator`, exit 1, naming
the fix: edit the CR, or delete it to hand the object to `apply`) unless ``--force``, which on-call may need while
the operator is away; the operator then leaves the record alone (its CR ``Ready=False ScalerWrittenByApply``) until
the record says what the CR says or is deleted. `apply` never writes that mark itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Literal, TextIO, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from manifests import scaledobject
from oncall.client import EXIT_REFUSED, positive_int_arg
from warmpool import buckets, protocol
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool.errors import BadMessage, NatsUnavailable, PermissionDenied, PulsescaleError
from warmpool.registry import ensure_buckets

__all__ = ["APPLY_RETRY_S", "DRY_RUN_CONNECT_S", "Applied", "PublishedByOperator", "apply", "load_manifests"]


class PublishedByOperator(PulsescaleError):
    """A record the Kubernetes operator published from a ScaledObject CR would be replaced: refused (exit 1)."""

    code = "published_by_operator"


def _unmarked(record: protocol.ScalerRecord) -> protocol.ScalerRecord:
    """`record` as `apply` writes and compares it: not managed by the operator (`ScalerRecord.unmanaged`)."""
    return record.unmanaged()


def _operators(
    manifests: Sequence[scaledobject.Manifest], previous: dict[str, protocol.ScalerRecord | None], *, force: bool
) -> list[scaledobject.Manifest]:
    """The manifests that would replace a record the operator published (one that says the same replaces
    nothing); `PublishedByOperator` for the first of them unless `force`."""
    hits = []
    for m in manifests:
        prev = previous.get(m.record.key)
        replaced = prev is not None and not scaledobject.same_content(_unmarked(prev), _unmarked(m.record))
        if prev is not None and prev.published_by_operator and replaced:
            hits.append(m)
    if hits and not force:
        rec = hits[0].record
        ns, name = rec.namespace, rec.name
        raise PublishedByOperator(
            f"{hits[0].where}: scaledobject {rec.key} was published by the Kubernetes operator from ScaledObject "
            f"{ns}/{name} (PublishedByOperator); apply does not replace it: change the CR (`kubectl -n {ns} edit pso "
            f"{name}`), or delete the CR (`kubectl -n {ns} delete pso {name}`) to hand the object to apply; on-call "
            "may override it with --force (the operator then leaves the record alone, its CR Ready=False "
            "ScalerWrittenByApply, until the record says what the CR says or is deleted)"
        )
    return hits


def _warn_forced(hits: Sequence[scaledobject.Manifest]) -> None:
    for m in hits:
        rec = m.record
        print(
            f"warning: {rec.key}: replacing the record the Kubernetes operator published from ScaledObject "
            f"{rec.namespace}/{rec.name} (--force); the operator leaves it alone and marks the CR Ready=False "
            "ScalerWrittenByApply until the record says what the CR says, or is deleted "
            f"(`pulsescale delete so {rec.name} -n {rec.namespace}`)",
            file=sys.stderr,
        )


def _read_stdin(stdin: TextIO) -> str:
    try:
        return stdin.read()
    except (OSError, UnicodeDecodeError) as err:
        raise scaledobject.ScaledObjectError("", f"cannot read it: {err}", where="<stdin>") from None


def load_manifests(
    paths: Sequence[str], *, recursive: bool, stdin: TextIO, now: float, max_replicas: int
) -> list[scaledobject.Manifest]:
    """Every ScaledObject of ``-f`` (files, directories, ``-`` for stdin; multi-document streams), all checked
    before any is written; a ``<namespace>.<name>`` defined twice anywhere is refused (the second would win).
    Documents of other kinds (the Deployment and Service beside a ScaledObject) are skipped, one stderr line
    each: kubectl applies them, `apply` writes only ScaledObjects."""
    manifests: list[scaledobject.Manifest] = []
    skipped: list[str] = []
    for path in paths:
        if path == "-":
            text = _read_stdin(stdin)
            manifests += scaledobject.load_documents(
                text, "<stdin>", updated_at=now, max_replicas=max_replicas, skipped=skipped
            )
        else:  # a file or a directory (-R: its subdirectories), read as kubectl apply -f does
            manifests += scaledobject.load_path(
                path, recursive=recursive, updated_at=now, max_replicas=max_replicas, skipped=skipped
            )
        for line in skipped:
            print(line, file=sys.stderr)
        skipped.clear()
    first: dict[str, scaledobject.Manifest] = {}
    models: dict[str, scaledobject.Manifest] = {}
    for m in manifests:
        seen = first.setdefault(m.record.key, m)
        if seen is not m:
            raise scaledobject.ScaledObjectError(
                "metadata.name",
                f"{m.record.key} is also defined by {seen.where}",
                where=m.where,
            )
        # One ScaledObject per model, across every -f too: the autoscaler would serve one and drop the other.
        other = models.setdefault(m.record.spec.model, m)
        if other is not m:
            raise scaledobject.ScaledObjectError(
                "spec.triggers[0].metadata.model",
                f"{m.record.spec.model} is also scaled by {other.record.key} ({other.where}); one ScaledObject per "
                "model: merge the two or give each its own model",
                where=m.where,
            )
    return manifests


DRY_RUN_CONNECT_S: Final = 1.0
"""How long ``apply --dry-run`` waits for NATS to read `pulse_scalers` (the model check) before it checks the
files alone: a dry run is also the offline check of a manifest, and must not hang on a missing server."""


async def _written(nc: Client) -> list[protocol.ScalerRecord]:
    """Every readable record of `pulse_scalers` (none when the bucket does not exist yet)."""
    js = nc.jetstream(timeout=5.0)
    try:
        kv = await js.key_value(protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []
    keys = await buckets.list_keys(js, protocol.SCALERS_BUCKET)
    out: list[protocol.ScalerRecord] = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted meanwhile
        if entry.value:
            try:
                out.append(protocol.decode(entry.value, protocol.ScalerRecord))
            except BadMessage:
                continue  # unreadable: the autoscaler serves nothing from it either
    return out


class Applied(msgspec.Struct, kw_only=True):
    """One ScaledObject as `apply -o json|yaml` reports it."""

    key: str
    action: Literal["created", "configured", "unchanged", "valid"]
    """``valid``: --dry-run, nothing written."""
    generation: int
    model: str
    notes: list[str] = []


APPLY_RETRY_S: Final = 10.0
"""How long `apply` asks again while a read or write of `pulse_scalers` finds no responder or times out: the first
write to a stream a fresh cluster just made can find no leader's interest yet (`nats: timeout`, seen on a new
3-server cluster; the cluster tests retry the same first write). A write that found no responder did not land;
one that timed out may have, and writing the same record again is harmless."""

_APPLY_RETRY_EVERY_S: Final = 0.25

_NOT_ANSWERED: Final = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)

T = TypeVar("T")


async def _answered(call: Callable[[], Awaitable[T]], *, deadline: float) -> T:
    """`call()`, asked again every `_APPLY_RETRY_EVERY_S` while it finds no responder or times out, until the
    monotonic `deadline` (then the last error is raised)."""
    while True:
        try:
            return await call()
        except _NOT_ANSWERED:
            if time.monotonic() + _APPLY_RETRY_EVERY_S >= deadline:
                raise
            await asyncio.sleep(_APPLY_RETRY_EVERY_S)


async def _write(nc: Client, manifests: list[scaledobject.Manifest], *, force: bool = False) -> list[Applied]:
    kv = (await ensure_buckets(nc.jetstream(timeout=5.0), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]
    deadline = time.monotonic() + APPLY_RETRY_S
    # Checked before any write: a model another ScaledObject already scales is refused, all or nothing.
    scaledobject.check_models(manifests, await _answered(lambda: _written(nc), deadline=deadline))
    previous_of: dict[str, protocol.ScalerRecord | None] = {}
    for m in manifests:
        previous = None
        try:
            entry = await _answered(functools.partial(kv.get, m.record.key), deadline=deadline)
            if entry.value is not None:
                previous = protocol.decode(entry.value, protocol.ScalerRecord)
        except nats.js.errors.KeyNotFoundError:
            pass
        except BadMessage:
            previous = None  # unreadable: overwrite it
        previous_of[m.record.key] = previous
    # Also before any write: a record the operator published is not replaced (unless --force).
    _warn_forced(_operators(manifests, previous_of, force=force))
    out: list[Applied] = []
    for m in manifests:
        rec = _unmarked(m.record)  # the operator's mark is its own: never written by apply
        previous = previous_of[rec.key]
        if previous is not None and previous.published_by_operator and force:
            previous = _unmarked(previous)  # compared (and its created_at kept) as apply's own
        if previous is not None and scaledobject.same_content(_unmarked(previous), rec):
            out.append(Applied(key=rec.key, action="unchanged", generation=previous.generation, model=rec.spec.model,
                               notes=rec.notes))  # fmt: skip
            continue
        gen = (previous.generation if previous is not None else 0) + 1
        # created_at: the first write's time, kept on every later one (initialCooldownPeriod counts from it).
        created = (previous.created_at if previous is not None else None) or rec.created_at or rec.updated_at
        value = protocol.encode(msgspec.structs.replace(rec, generation=gen, created_at=created))
        await _answered(functools.partial(kv.put, rec.key, value), deadline=deadline)
        action: Literal["created", "configured"] = "configured" if previous else "created"
        out.append(Applied(key=rec.key, action=action, generation=gen, model=rec.spec.model, notes=rec.notes))
    return out


def _summary(rec: protocol.ScalerRecord) -> str:
    s = rec.spec
    paused = ""
    if rec.paused:
        paused = f", paused at {rec.paused_replicas}" if rec.paused_replicas is not None else ", paused"
    if rec.paused_scale_in:
        paused += ", paused scale-in"
    if s.advanced.scale_down_select_policy == "Disabled" and not rec.paused_scale_in:
        paused += ", no scale-in (scaleDown.selectPolicy: Disabled)"
    if rec.paused_scale_out:
        hpa = s.advanced.horizontal_pod_autoscaler_config
        up = hpa.behavior.scale_up if hpa is not None and hpa.behavior is not None else None
        disabled = up is not None and up.select_policy == "Disabled"
        paused += ", paused scale-out (scaleUp.selectPolicy: Disabled)" if disabled else ", paused scale-out"
    return (
        f" (model {s.model}, replicas {s.min_replica_count}..{s.max_replica_count}, "
        f"warm pool {s.warm_pool.size}{paused})"
    )


def apply(argv: list[str], prog: str, *, stdin: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"Write ScaledObjects ({scaledobject.API_VERSION}, the YAML the CRD takes) to KV "
        f"{protocol.SCALERS_BUCKET}, for use without Kubernetes; needs the operator's NATS user. Every document of "
        "every file is checked before any is written.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE|DIR",
        help="a YAML file (multi-document streams too), a directory of .yaml/.yml/.json files, or '-' for stdin; "
        "repeatable",
    )
    p.add_argument("-R", "--recursive", action="store_true", help="with -f DIR: its subdirectories too")
    p.add_argument("--dry-run", action="store_true", help="check the files and print what would be written")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace records the Kubernetes operator published from ScaledObject CRs (on-call, while the operator "
        "cannot be used); the operator then leaves them alone until they say what their CRs say or are deleted",
    )
    p.add_argument(
        "--max-replicas",
        type=positive_int_arg,
        metavar="N",
        help=f"refuse replica counts over N [$PULSESCALE_MAX_REPLICAS or {protocol.DEFAULT_MAX_REPLICAS}]",
    )
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    now = time.time()
    try:
        limit = args.max_replicas or scaledobject.max_replicas_from_env(os.environ)
        manifests = load_manifests(
            args.filename, recursive=args.recursive, stdin=stdin or sys.stdin, now=now, max_replicas=limit
        )
    except scaledobject.ScaledObjectError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return EXIT_REFUSED
    if args.dry_run:
        # The model check needs pulse_scalers: read it if NATS answers soon, else say it was not done.
        opts = nats_connect.options_from_args(args, name="pulsescale-apply-dry-run")
        opts = dataclasses.replace(opts, connect_deadline_s=min(opts.connect_deadline_s, DRY_RUN_CONNECT_S))
        try:
            written = asyncio.run(nats_connect.run_client(opts, _written))
        except (NatsUnavailable, nats.errors.Error, TimeoutError) as err:
            print(
                f"{prog}: note: {protocol.SCALERS_BUCKET} not read ({err}); the files are checked, not whether "
                "another ScaledObject already scales their models",
                file=sys.stderr,
            )
            written = []
        try:
            scaledobject.check_models(manifests, written)
            _operators(manifests, {r.key: r for r in written}, force=args.force)
        except (scaledobject.ScaledObjectError, PublishedByOperator) as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return EXIT_REFUSED
        results = [
            Applied(key=m.record.key, action="valid", generation=m.record.generation, model=m.record.spec.model,
                    notes=m.record.notes)
            for m in manifests
        ]  # fmt: skip
    else:
        opts = nats_connect.options_from_args(args, name="pulsescale-apply")
        try:
            results = asyncio.run(nats_connect.run_client(opts, lambda nc: _write(nc, manifests, force=args.force)))
        except (scaledobject.ScaledObjectError, PublishedByOperator) as err:
            print(f"{prog}: {err}", file=sys.stderr)
            return EXIT_REFUSED
        except PermissionDenied as err:
            print(f"{prog}: {err}; writing {protocol.SCALERS_BUCKET} needs the operator's NATS user", file=sys.stderr)
            return EXIT_REFUSED
        except (nats.errors.Error, TimeoutError) as err:
            print(f"{prog}: writing to {protocol.SCALERS_BUCKET} failed: {err}", file=sys.stderr)
            return EXIT_REFUSED
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(results, fmt))
        return 0
    records = {m.record.key: m.record for m in manifests}
    for r in results:
        tail = " (dry run: nothing written)" if r.action == "valid" else ""
        print(f"scaledobject {r.key} {r.action}{_summary(records[r.key])}{tail}")
        for note in r.notes:
            print(f"note: {r.key}: {note}")
    return 0
