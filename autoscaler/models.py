"""The models this replica knows, and which of them it owns: the one owner of the daemon's shared tables.

Every part of the daemon asks the same questions (is there a controller for this model, does this replica act
for it, which models are in the shards it holds), and the answers rest on the same state: the controllers by model,
by ScaledObject and by shard, the shards held, and the shard leases and command service made once the daemon has
started. `Models` holds that state, so it has one owner instead of a dict shared by five classes, and the parts
(`autoscaler.ownership`, `autoscaler.intake`, `autoscaler.slotview`, `autoscaler.retire`,
`autoscaler.subscriptions`) take it whole instead of dicts, callables and late-bound lambdas. The daemon makes it
first; only `add` and `remove` change the three tables, so they stay consistent. The daemon composes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from autoscaler.commands.service import CommandService
from autoscaler.controller import ModelController
from autoscaler.shards.leases import ShardLeases
from warmpool import protocol

__all__ = ["Models"]


class Models:
    """The controllers of the models with a ScaledObject (every one, whoever owns it) and this replica's shards."""

    def __init__(self) -> None:
        self.by_model: dict[str, ModelController] = {}
        """The controllers, by model (read on every sample)."""
        self.by_scaler: dict[str, ModelController] = {}
        """The same controllers, by the key of their ScaledObject in `pulse_scalers`."""
        self.by_shard: dict[int, set[str]] = {}
        """Models with a ScaledObject, by shard (`protocol.shard_of`)."""
        self.held: set[int] = set()
        """The shards held, as `ShardLeases`' callbacks said (`Ownership` keeps it): the leadership gauges and the
        sample subscriptions follow it; acting is fenced by `owns` instead."""
        self.shards: ShardLeases | None = None
        """The shard leases (`autoscaler.shards.leases`), once the daemon has made them: this replica acts for the
        models of the shards it holds."""
        self.commands: CommandService | None = None
        """The on-call command service (`autoscaler.commands.service`), once the daemon has made it."""
        self.subjects_changed = asyncio.Event()
        """The models this replica owns changed: `SampleSubscriptions.follow_subjects` re-subscribes the samples it
        needs."""

    def add(self, key: str, c: ModelController) -> None:
        """ScaledObject `key` now scales `c.model` with the controller `c`."""
        self.by_scaler[key] = c
        self.by_model[c.model] = c
        self.by_shard.setdefault(protocol.shard_of(c.model), set()).add(c.model)
        self.subjects_changed.set()

    def remove(self, key: str) -> ModelController | None:
        """ScaledObject `key` scales nothing any more: its controller (None: there was none), out of every table."""
        c = self.by_scaler.pop(key, None)
        if c is not None:
            self.by_model.pop(c.model, None)
            self.by_shard.get(protocol.shard_of(c.model), set()).discard(c.model)
            self.subjects_changed.set()
        return c

    def holds_shards(self) -> bool:
        """Acts for at least one shard (answers on-call commands, counts as leading in ``/healthz``)."""
        return self.shards is not None and bool(self.shards.held())

    def owns_shard(self, shard: int) -> bool:
        """This replica acts for `shard` now (it holds its lease, fenced)."""
        return self.shards is not None and self.shards.owns(shard)

    def owns(self, model: str) -> bool:
        """This replica acts for `model` now (it holds the lease of its shard, fenced). Asked for every sample."""
        return self.shards is not None and self.shards.owns_model(model)

    def owner_of(self, model: str) -> str | None:
        """The replica holding `model`'s shard, as last seen (None: none, or no leases yet)."""
        return self.shards.owner_of_model(model) if self.shards is not None else None

    def owned(self) -> Iterator[str]:
        """The models with a ScaledObject in the shards held (`held`)."""
        for shard in self.held:
            yield from self.by_shard.get(shard, ())

    def models_owned(self) -> int:
        """ScaledObjects in the shards this replica holds (its `ReplicaRecord.models`)."""
        return sum(len(self.by_shard.get(s, ())) for s in self.held)
