"""Tests of the simulator and its baselines."""
