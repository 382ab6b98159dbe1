"""Tests of the autoscaler daemon: decide, act, shards, commands."""
