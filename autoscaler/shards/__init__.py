"""The shard leases: which replica acts for which model.

`leases` (`ShardLeases`) holds this replica's share of the 32 shards in `pulse_leases`, `terms` takes, renews and gives
them, `assign` computes the plan every replica computes alike, `leader` is the one fenced lease both build on, and
`renewer` is the thread the renewals run on.
"""
