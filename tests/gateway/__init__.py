"""Tests of the reference gateway."""
