"""Tests of the node agent, its engines and staging."""
