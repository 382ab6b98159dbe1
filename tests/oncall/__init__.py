"""Tests of the on-call client."""
