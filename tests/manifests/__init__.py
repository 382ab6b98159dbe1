"""Tests of the ScaledObject reader and the CRD."""
