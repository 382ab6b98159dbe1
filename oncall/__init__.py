"""The on-call client: the `pulsescale` commands a person runs against the autoscaler and the ScaledObject registry.

`client` sends one command of the contract and says how it ended (exit codes, `CommandFailed`); `verbs` holds
scale, pause, resume, schedule, status, pool, drain and undrain; `get`, `describe` and `delete` treat
ScaledObjects, slots and models as kubectl treats resources; `apply` writes ScaledObjects from YAML. The package
stands on the wire contract (`warmpool`, `warmpool.protocol`) and the manifest reader (`manifests`) only, never on
a daemon's modules. The dispatcher (`pulsescale.cli`) imports each command's module when that command runs.
"""
