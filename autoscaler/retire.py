"""The slots of deleted ScaledObjects, given back (the operator's finalizer waits for that).

By the model's owner when the delete arrives (`Retirement.retire`: the retiring controller deactivates and
releases what it holds), else by a later owner's sweep for held slots no ScaledObject owns
(`Retirement.sweep_unowned`, from the daemon's housekeeping once per turn round). The daemon composes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client

from autoscaler.act.agentclient import AgentClient, AgentUnavailable
from autoscaler.controller import ControllerSettings, ModelController
from autoscaler.models import Models
from warmpool.errors import PulsescaleError, StaleToken
from warmpool.registry import Claim, KvSlotStore

__all__ = ["Retirement"]

log = logging.getLogger("pulsescale.autoscaler")


class Retirement:
    """Releases the slots of models no ScaledObject scales any more (`models`, the daemon's `Models`)."""

    def __init__(
        self,
        nc: Client,
        store: KvSlotStore,
        models: Models,
        *,
        settings: ControllerSettings,
        clock: Callable[[], float],
    ) -> None:
        self.nc = nc
        self.store = store
        self.models = models
        """The models with a ScaledObject, and whether this replica acts for a model now (`Models.owns`)."""
        self.settings = settings
        self.clock = clock
        self.retiring: set[asyncio.Future[int]] = set()  # deleted ScaledObjects releasing their slots
        self._sweeping: set[str] = set()

    def retire(self, key: str, c: ModelController) -> None:
        """ScaledObject `key` was deleted: its controller `c` (no longer in `Models.by_model`) releases its slots."""
        task = asyncio.ensure_future(c.retire(f"ScaledObject {key} deleted"))
        self.retiring.add(task)
        task.add_done_callback(self._retired)

    def _retired(self, task: asyncio.Future[int]) -> None:
        self.retiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing the slots of a deleted ScaledObject failed: %s", task.exception())

    def sweep_unowned(self, now: float) -> None:
        """Release slots held for a model no ScaledObject scales: its ScaledObject was deleted while no leader
        was there to release them (`Autoscaler.apply_scaler` does when one is), and the operator's finalizer
        waits for them. Only the autoscaler claims slots, so a held slot of an unscaled model is nobody's. A grace
        of two activation deadlines since the record's last write leaves alone a claim whose ScaledObject is
        arriving."""
        grace_s = 2 * self.settings.activation_deadline_s
        agents: AgentClient | None = None
        # By model first: once per second over a fleet's slots (12,000 for 3,000 models) was 3 % of a replica's CPU,
        # and nearly every model has its ScaledObject.
        for model in self.store.index.models():
            if model in self.models.by_model or not self.models.owns(model):  # the owner of its shard sweeps it
                continue
            for rec in self.store.records(model):
                if (
                    rec.key in self._sweeping
                    or rec.state not in ("claimed", "activating", "ready")
                    or self.store.index.unchanged_s(rec.key) < grace_s  # on our clock: an agent's may be off
                ):
                    continue
                claim = self.store.adopt(rec.key)
                if claim is None:
                    continue
                log.warning("slot %s is held for %s, which no ScaledObject scales: releasing it", rec.key, model)
                self._sweeping.add(rec.key)
                agents = agents or AgentClient(self.nc, clock=self.clock, skew=self.store.index.clock_skew)
                task = asyncio.ensure_future(self._release_unowned(agents, claim))
                task.add_done_callback(functools.partial(self._swept, rec.key))

    def _swept(self, key: str, task: asyncio.Future[None]) -> None:
        self._sweeping.discard(key)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing %s failed: %s", key, task.exception())

    async def _release_unowned(self, agents: AgentClient, claim: Claim) -> None:
        with contextlib.suppress(AgentUnavailable):
            await agents.deactivate(claim, timeout_s=self.settings.deactivate_timeout_s)
        try:
            await self.store.release(claim, reason="its ScaledObject was deleted")
        except StaleToken:
            pass  # the agent gave it back on deactivate
        except (PulsescaleError, nats.errors.Error, TimeoutError) as err:
            log.warning("could not release %s (%s); the next sweep tries again", claim.key, err)
