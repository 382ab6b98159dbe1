"""The operator's records: the ScaledObjects' records in `pulse_scalers`, the slots in `pulse_slots` a deleted one
waits for, which namespace owns which model (`ModelOwners`, a ConfigMap in the operator's own namespace), and the
copy of each CR's conditions in `pulse_objects` (`ObjectMirror`, contract revision 13), swept of records whose CR is
gone (`MirrorSweep`).

`Records` is the only code of the operator that touches either bucket: it reads a record (an unreadable one is
absent), publishes one, withdraws one (a delete marker the autoscaler's watch sees), finds another published record
that scales the same model (the one-ScaledObject-per-model rule, and whether the model's slots stay claimed after a
delete), and lists a model's held slots (`HELD_SLOT_STATES`) for the finalizer. Records are keyed
``<namespace>.<name>`` (`record_key`), as the autoscaler's `StatusRow.key`.

A model name is cluster-wide (one controller per model in the autoscaler, one set of slots) while ScaledObjects are
namespaced, written by tenants. `ModelOwners` is the rule that keeps a tenant from squatting another's model:

- the ConfigMap `MODEL_OWNERS_CONFIGMAP` in the operator's namespace (``OperatorContext.home_namespace``, beside
  its Lease; tenants cannot write there) maps ``<model>: <namespace>``;
- a model with no entry is claimed by the namespace of the first ScaledObject the operator publishes for it: the
  entry is written (compare-and-set on the ConfigMap's resourceVersion) before the record, so nothing is published
  without its owner on file;
- the entry outlives the ScaledObjects: an operator restart, or the owner deleting and re-creating its object,
  does not free the model, so no squatter can take it in that window. Only the platform team moves or frees a model
  (``kubectl -n <operator namespace> edit configmap pulsescale-model-owners``), and it may write entries before any
  ScaledObject exists: an explicit claim, so that first-come cannot win a model meant for another team.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException
from nats.js.kv import KeyValue

from kube.context import OperatorContext
from manifests import scaledobject
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import protocol
from warmpool.errors import BadMessage, PulsescaleError

__all__ = [
    "HELD_SLOT_STATES",
    "MODEL_OWNERS_CONFIGMAP",
    "ModelOwners",
    "MIRROR_RETRY_S",
    "MIRROR_SCAN_TIMEOUT_S",
    "MIRROR_TIMEOUT_S",
    "MirrorSweep",
    "ModelOwnersUnavailable",
    "ObjectMirror",
    "Records",
    "applied_by_hand",
    "applied_message",
    "marked",
    "record_key",
    "unlisted",
    "unmarked",
]

HELD_SLOT_STATES: Final = frozenset({"claimed", "activating", "ready", "releasing"})
"""Slot states that mean a model still holds the slot; the finalizer waits until none is left."""
MODEL_OWNERS_CONFIGMAP: Final = "pulsescale-model-owners"
"""The ConfigMap of model owners; its Role in deploy/ names it (``resourceNames``), so it is not a flag."""
CLAIM_TRIES: Final = 5  # compare-and-set rounds of one claim before giving up (each loss is another writer's win)
MIRROR_TIMEOUT_S: Final = 2.0
"""How long one write to `pulse_objects` may take: the mirror is written inside the status round, which must not
stall on it (a refused publish is never answered, it times out)."""
MIRROR_SCAN_TIMEOUT_S: Final = 10.0
"""How long the sweep's reads may take (the keys of `pulse_objects`, waited for between two of them; the LIST of the
ScaledObjects): one that does not answer skips the sweep, which runs in its own loop and holds nothing up."""
MIRROR_RETRY_S: Final = 30.0
"""After `pulse_objects` could not be opened or written (absent until an autoscaler of revision 13 creates it; an
authorization rendered before revision 13), how long the operator leaves it before trying again."""

log = logging.getLogger("pulsescale.operator")


class ModelOwnersUnavailable(PulsescaleError):
    """The ConfigMap of model owners could not be read or written: nothing new is published until it can be."""

    code = "model_owners_unavailable"


def record_key(namespace: str, name: str) -> str:
    """An object's key in `pulse_scalers` (and its row's `StatusRow.key`)."""
    return f"{namespace}.{name}"


def marked(record: protocol.ScalerRecord) -> protocol.ScalerRecord:
    """`record` as the operator publishes it: `ScalerRecord.managed_by` the operator (who may replace it: ``pulsescale
    apply`` refuses to)."""
    return msgspec.structs.replace(record, managed_by=protocol.ScalerRecord.OPERATOR)


def unmarked(record: protocol.ScalerRecord) -> protocol.ScalerRecord:
    """`record` as ``pulsescale apply`` writes it (`ScalerRecord.unmanaged`)."""
    return record.unmanaged()


def applied_by_hand(previous: protocol.ScalerRecord | None, record: protocol.ScalerRecord) -> bool:
    """Whether `previous`, the record under the CR's key, was written by ``pulsescale apply`` (not managed by the
    operator) and says something else than the CR's `record`: then it is not the operator's to replace. One that
    says the same (a hand-back, or a record of an operator from before revision 14) is taken over."""
    if previous is None or previous.published_by_operator:
        return False
    return not scaledobject.same_content(unmarked(previous), unmarked(record))


def applied_message(namespace: str, name: str) -> str:
    """The ``Ready=False ScalerWrittenByApply`` message."""
    key = record_key(namespace, name)
    return (
        f"{protocol.SCALERS_BUCKET}/{key} was written by `pulsescale apply` (not from this ScaledObject) and stays in "
        "force; the operator publishes nothing over it. To hand it back: make this ScaledObject say what the record "
        f"says (`pulsescale get so {name} -n {namespace} -o yaml` shows it), and the operator takes it over; or "
        f"delete the record (`pulsescale delete so {name} -n {namespace}`; the autoscaler releases the model's "
        "slots) and this ScaledObject is published within a status round"
    )


class Records:
    """The records of one `OperatorContext`'s buckets (``ctx.scalers``, ``ctx.slots``)."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    async def read(self, key: str) -> protocol.ScalerRecord | None:
        """The record under `key`; None when there is none or it does not decode."""
        try:
            entry = await self.ctx.scalers.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            return protocol.decode(entry.value, protocol.ScalerRecord)
        except BadMessage:
            return None  # unreadable: treated as absent, overwritten by the next valid write

    async def publish(self, key: str, record: protocol.ScalerRecord) -> None:
        """Writes the record (the autoscaler's watch sees it)."""
        await self.ctx.scalers.put(key, protocol.encode(record))

    async def withdraw(self, key: str) -> bool:
        """Deletes the record (a delete marker: the autoscaler's watch sees it) if the operator published it
        (`ScalerRecord.published_by_operator`: one ``pulsescale apply`` wrote is left alone). True if it did."""
        record = await self.read(key)
        if record is None or not record.published_by_operator:
            return False
        await self.ctx.scalers.delete(key)
        return True

    async def model_conflict(self, model: str, key: str) -> str | None:
        """Another published record that scales `model`, as a message. The autoscaler runs one controller per model
        and ignores a second record naming it (first seen wins), so this object would look Ready and do nothing.
        Only asked while this object is not published: of two published ones the autoscaler keeps the first."""
        try:
            keys = await self.ctx.scalers.keys()
        except nats.js.errors.NoKeysError:
            return None
        for other in sorted(keys):
            if other == key:
                continue
            record = await self.read(other)
            if record is not None and record.spec.model == model:
                return (
                    f"model {model} is already scaled by ScaledObject {record.namespace}/{record.name} "
                    f"({protocol.SCALERS_BUCKET}/{other}); one ScaledObject per model: delete one of them, or name "
                    "another model in this one's trigger"
                )
        return None

    async def model_still_scaled(self, model: str, except_key: str) -> bool:
        """Whether another ScaledObject's record names `model` (its slots then stay claimed by design)."""
        try:
            keys = await self.ctx.scalers.keys()
        except nats.js.errors.NoKeysError:
            return False
        for k in keys:
            if k == except_key:
                continue
            record = await self.read(k)
            if record is not None and record.spec.model == model:
                return True
        return False

    async def held_slots(self, model: str) -> list[str]:
        """The keys of `model`'s slots that it still holds (`HELD_SLOT_STATES`)."""
        try:
            keys = await self.ctx.slots.keys()
        except nats.js.errors.NoKeysError:
            return []
        held = []
        for k in keys:
            if not k.startswith(f"{model}."):
                continue
            try:
                entry = await self.ctx.slots.get(k)
                if entry.value is None:
                    continue
                slot = protocol.decode(entry.value, protocol.SlotRecord)
            except (nats.js.errors.KeyNotFoundError, BadMessage):
                continue
            if slot.model == model and slot.state in HELD_SLOT_STATES:
                held.append(k)
        return held


class ModelOwners:
    """The ConfigMap of model owners (see the module docstring), read and claimed through one `OperatorContext`."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    @property
    def where(self) -> str:
        return f"{self.ctx.home_namespace}/{MODEL_OWNERS_CONFIGMAP}"

    async def _read(self) -> Any | None:
        """The ConfigMap (a `kubernetes` model), None when it does not exist yet."""
        try:
            return await self.ctx.call(
                self.ctx.core.read_namespaced_config_map, MODEL_OWNERS_CONFIGMAP, self.ctx.home_namespace
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise self._unavailable("read", err) from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise self._unavailable("read", err) from None

    def _unavailable(self, what: str, err: BaseException) -> ModelOwnersUnavailable:
        said = f"{err.status} {err.reason}" if isinstance(err, ApiException) else (str(err).splitlines() or [""])[0]
        fix = " (the operator's Role in its namespace must grant it: deploy/base/operator/rbac.yaml)"
        return ModelOwnersUnavailable(
            f"cannot {what} ConfigMap {self.where}, the record of which namespace owns which model: {said}"
            + (fix if isinstance(err, ApiException) and err.status == 403 else "")
        )

    def refusal(self, model: str, owner: str) -> str:
        """The ``Ready=False ModelOwnedByOtherNamespace`` message."""
        return (
            f"model {model} is owned by namespace {owner} (ConfigMap {self.where}); a model is scaled only from the "
            f"namespace that owns it: name another model in this trigger, or ask the platform team to move {model} "
            "to this namespace"
        )

    async def read(self) -> dict[str, str]:
        """model -> owning namespace."""
        cm = await self._read()
        return dict((cm.data if cm is not None else None) or {})

    async def owner(self, model: str) -> str | None:
        """The namespace that owns `model`, None when nobody does."""
        return (await self.read()).get(model)

    async def claim(self, model: str, namespace: str) -> str:
        """Makes `namespace` the owner of `model` unless a namespace already is; returns the owner. A
        compare-and-set on the resourceVersion read (create when the ConfigMap is missing): of two claims racing
        (two objects, or a replica that has just lost its Lease) exactly one is written, the other reads it."""
        core, home = self.ctx.core, self.ctx.home_namespace
        for _ in range(CLAIM_TRIES):
            cm = await self._read()
            owners = dict((cm.data if cm is not None else None) or {})
            if model in owners:
                return str(owners[model])
            try:
                if cm is None:
                    await self.ctx.call(core.create_namespaced_config_map, home, {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {"name": MODEL_OWNERS_CONFIGMAP,
                                     "labels": {"app.kubernetes.io/part-of": "pulsescale",
                                                "app.kubernetes.io/managed-by": "pulsescale-operator"}},
                        "data": {model: namespace},
                    })  # fmt: skip
                else:
                    cm.data = {**owners, model: namespace}  # with the resourceVersion read: a 409 if it changed
                    await self.ctx.call(core.replace_namespaced_config_map, MODEL_OWNERS_CONFIGMAP, home, cm)
            except ApiException as err:
                if err.status == 409:
                    continue  # another writer was first: read again
                raise self._unavailable("write", err) from None
            except (urllib3.exceptions.HTTPError, OSError) as err:
                raise self._unavailable("write", err) from None
            return namespace
        raise ModelOwnersUnavailable(
            f"could not record the owner of model {model} in ConfigMap {self.where}: it changed under each of "
            f"{CLAIM_TRIES} tries"
        )


class ObjectMirror:
    """`pulse_objects` (contract revision 13): each ScaledObject's `protocol.ObjectStatus`, written with its status
    (kube/statuswriter.py) when its content changed since this operator last wrote it, deleted with the CR.

    The mirror is for people (``pulsescale get so``), so it never holds the operator up: a bucket that does not
    exist yet, or that this NATS user may not write, is said once and left for `MIRROR_RETRY_S`; the CRs are
    written as before meanwhile, and the next round after it opens writes every object again."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx
        self._kv: KeyValue | None = None
        self._retry_at = 0.0  # time.monotonic() before which the bucket is not tried again
        self._written: dict[str, bytes] = {}
        """Key -> the content last written (`updated_at` aside): an unchanged status writes nothing."""
        self._writing: set[str] = set()  # keys whose put is on its way (`sweep` leaves them)
        self._said = False
        self.retry_s = MIRROR_RETRY_S

    def wrote(self, key: str) -> bool:
        """Whether this operator wrote `key` and has not deleted it since."""
        return key in self._written

    async def write(self, record: protocol.ObjectStatus) -> None:
        content = protocol.encode(msgspec.structs.replace(record, updated_at=0.0))
        if self._written.get(record.key) == content:
            return
        kv = await self._bucket()
        if kv is None:
            return
        self._writing.add(record.key)
        try:
            await kv.put(record.key, protocol.encode(record))
        except (nats.errors.Error, TimeoutError) as err:
            self._unavailable(f"cannot be written ({_said(err)})")
            return
        finally:
            self._writing.discard(record.key)
        if self._said:
            log.info("%s is written again", protocol.OBJECTS_BUCKET)
            self._said = False
        self._written[record.key] = content

    async def delete(self, key: str) -> None:
        """Removes `key` (a delete marker). A bucket out of reach leaves it: `pulsescale get so` then lists the
        object as it last was, until the key is written or deleted again."""
        self._written.pop(key, None)
        kv = await self._bucket()
        if kv is None:
            return
        try:
            await kv.delete(key)
        except (nats.errors.Error, TimeoutError) as err:
            self._unavailable(f"cannot be written ({_said(err)}); {key} stays listed as it was")

    async def keys(self, namespaces: Iterable[str] = ()) -> list[str] | None:
        """The keys in `pulse_objects` of `namespaces` (none named: every key); None when they cannot be read now.
        Headers only, one filtered scan per namespace: the records of other namespaces are not read."""
        kv = await self._bucket()
        if kv is None:
            return None
        found: list[str] = []
        try:
            for pattern in [f"{ns}.>" for ns in namespaces] or [">"]:
                watcher = await kv.watch(pattern, ignore_deletes=True, meta_only=True)
                try:
                    while (entry := await watcher.updates(timeout=MIRROR_SCAN_TIMEOUT_S)) is not None:
                        found.append(entry.key)
                finally:
                    await watcher.stop()
        except (nats.errors.Error, TimeoutError) as err:
            log.debug("the keys of %s cannot be read (%s)", protocol.OBJECTS_BUCKET, _said(err))
            return None
        return found

    async def sweep(self, key: str) -> bool:
        """Deletes `key` (a record whose ScaledObject is gone: `MirrorSweep`) unless this operator wrote it or is
        writing it, and only if nobody has written it since it is read here: the delete is conditional on the
        revision read, so a record put for a ScaledObject created meanwhile is never removed. True if deleted."""
        kv = await self._bucket()
        if kv is None:
            return False
        try:
            entry = await kv.get(key)
            if self.wrote(key) or key in self._writing:
                return False  # its object's own writes and delete own it
            await kv.delete(key, last=entry.revision)
        except nats.js.errors.KeyNotFoundError:
            return False  # already gone
        except (nats.errors.Error, TimeoutError) as err:  # a newer revision (KeyWrongLastSequenceError), or no answer
            log.debug("%s/%s not swept: %s", protocol.OBJECTS_BUCKET, key, _said(err))
            return False
        return True

    async def _bucket(self) -> KeyValue | None:
        if self._kv is not None:
            return self._kv
        if time.monotonic() < self._retry_at:
            return None
        try:
            self._kv = await self.ctx.nc.jetstream(timeout=MIRROR_TIMEOUT_S).key_value(protocol.OBJECTS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            self._unavailable("does not exist: an autoscaler of contract revision 13 or later creates it")
        except (nats.errors.Error, TimeoutError) as err:
            self._unavailable(f"cannot be opened ({_said(err)})")
        return self._kv

    def _unavailable(self, why: str) -> None:
        self._kv = None
        self._retry_at = time.monotonic() + self.retry_s
        self._written.clear()  # whatever it held may not be there now: write each object again once it opens
        say = log.debug if self._said else log.warning
        say(
            "bucket %s %s; `pulsescale get so` may not say what the CRs say until it can be written (the "
            "operator's NATS user needs the grants of revision 13: `pulsescale nats --print-authorization`); trying "
            "again in %.0f s",
            protocol.OBJECTS_BUCKET, why, self.retry_s,
        )  # fmt: skip
        self._said = True


def unlisted(keys: Iterable[str], listed: Collection[str], namespaces: Collection[str]) -> list[str]:
    """The keys of `pulse_objects` (``<namespace>.<name>``) in `namespaces` (empty: every namespace) that name no
    ScaledObject of `listed` (their keys): what a sweep deletes once `listed` is a complete listing of those
    namespaces. A key without a namespace part is no object's and is left alone."""
    out = []
    for key in keys:
        namespace, dot, name = key.partition(".")
        if dot and name and (not namespaces or namespace in namespaces) and key not in listed:
            out.append(key)
    return sorted(out)


class MirrorSweep:
    """Deletes the records of `pulse_objects` whose ScaledObject no longer exists, in this operator's namespaces.

    The mirror deletes a record with its CR (the finalizer, or a DELETED event), but a CR deleted while no operator
    led, one whose delete could not reach the bucket, or a namespace an operator no longer watches leaves its record
    behind, and ``pulsescale get so`` lists an object that is gone. `round` runs when the operator starts leading and
    then every `OperatorContext.mirror_sweep_every_s` (kube/operator.py `ScaledObjects.run_loops`):

    - only the keys of the namespaces this operator watches (`OperatorContext.namespaces`; every key when it watches
      all of them): in the namespaced mode several operators share the bucket, and another's records are its own;
    - a key this replica wrote (`ObjectMirror.wrote`) is an object it follows: its own delete removes it. The others
      are suspects; none, and the round ends there (the usual case once every object's status has been mirrored);
    - suspects are judged against a LIST of the ScaledObjects, made after the keys were read and complete (every
      watched namespace answered, or the cluster-wide list): a key it lacks names an object that did not exist when
      the key was already there. A failed LIST sweeps nothing: an incomplete view would delete live records. kopf's
      own listing is not used: it says nowhere when it is complete, and the handlers see objects one at a time;
    - each delete is conditional on the revision read (`ObjectMirror.sweep`), so a record just written for an object
      created after the LIST stays; and made only while this replica leads (``ctx.extra["leading"]``).

    Each swept key is logged once at INFO with the reason and counted in `OperatorContext.mirror_swept`."""

    def __init__(self, ctx: OperatorContext, mirror: ObjectMirror) -> None:
        self.ctx = ctx
        self.mirror = mirror
        self._said = False  # a failed LIST said at WARNING once, until a sweep completes

    def _leading(self) -> bool:
        fn = self.ctx.extra.get("leading")
        return bool(fn()) if callable(fn) else True

    async def round(self) -> int:
        """One sweep; the number of records deleted."""
        if not self._leading():
            return 0
        keys = await self.mirror.keys(self.ctx.namespaces)
        suspects = [k for k in keys or () if not self.mirror.wrote(k)]
        if not suspects:
            return 0
        listed = await self._listed()
        if listed is None:
            return 0
        swept = 0
        for key in unlisted(suspects, listed, self.ctx.namespaces):
            if not self._leading():
                break
            if await self.mirror.sweep(key):
                swept += 1
                self.ctx.mirror_swept += 1
                namespace, _, name = key.partition(".")
                log.info(
                    "swept %s/%s: ScaledObject %s/%s does not exist (deleted while no operator led, or its delete "
                    "did not reach the bucket); `pulsescale get so` no longer lists it",
                    protocol.OBJECTS_BUCKET, key, namespace, name,
                )  # fmt: skip
        return swept

    async def _listed(self) -> set[str] | None:
        """The keys of every ScaledObject in this operator's namespaces, from one complete LIST; None if any part of
        it failed."""
        custom, timeout = self.ctx.custom, MIRROR_SCAN_TIMEOUT_S
        pages: list[Any] = []
        try:
            if self.ctx.clusterwide:
                pages.append(await self.ctx.call(custom.list_cluster_custom_object, GROUP, VERSION, PLURAL,
                                                 _request_timeout=timeout))  # fmt: skip
            for ns in self.ctx.namespaces:
                pages.append(await self.ctx.call(custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                                                 _request_timeout=timeout))  # fmt: skip
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as err:
            said = f"{err.status} {err.reason}" if isinstance(err, ApiException) else _said(err)
            (log.debug if self._said else log.warning)(
                "not sweeping %s: the ScaledObjects could not be listed (%s); a record whose object is gone stays "
                "listed by `pulsescale get so` until a sweep can list them (every %.0f s)",
                protocol.OBJECTS_BUCKET, said, self.ctx.mirror_sweep_every_s,
            )  # fmt: skip
            self._said = True
            return None
        self._said = False
        listed: set[str] = set()
        for page in pages:
            for item in page.get("items") or []:
                meta = item.get("metadata") or {}
                listed.add(record_key(str(meta.get("namespace", "")), str(meta.get("name", ""))))
        return listed


def _said(err: BaseException) -> str:
    return str(err) or type(err).__name__
