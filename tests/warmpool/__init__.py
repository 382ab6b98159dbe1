"""Tests of the shared core: the wire contract, the slot lifecycle, placement, the registry, NATS."""
