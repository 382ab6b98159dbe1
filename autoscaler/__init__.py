"""autoscaler — the daemon (`pulsescale autoscaler`): gateway samples in, warm slots claimed and released.

Every replica follows the ScaledObjects in `pulse_scalers` and acts for the models of the shards it holds (32
shard leases in `pulse_leases`, assigned over the live replicas; there is no single leader). Its parts:

- `decide/` — pure, no I/O: ingest, the pulse detector, the need, the policy (and its terms, holds, scale-in and
  settling), schedules, and per model the `decider`;
- `act/` — per model the `scaler`: its book of held slots, the slot actions (claim, activate, release), the
  cold path, and the typed client of the agents' verbs;
- `shards/` — the shard leases, their terms, the plan (`assign`) and the lease primitives (`leader`);
- `commands/` — the on-call command service (``pulse.cmd.<verb>``): routing, verbs, status rows;
- `stored/` — on-call overrides and schedules kept in `pulse_leases`, so a new owner restores them;
- at this level: `controller` (one per model, joining a decider and a scaler), `models` (the one owner of the
  per-model, per-ScaledObject and per-shard tables), `daemon` (composes the rest: `subscriptions` and `intake`
  for the samples, `ownership` for shards taken and lost, `retire`, `slotview`, `endpoints`, `metrics`), `cli`.

The layers are import-linter contracts in pyproject.toml; the on-call client (`oncall`), the manifest reader
(`manifests`) and the decision bench (`pulsescale.bench`) live outside this package.
"""
