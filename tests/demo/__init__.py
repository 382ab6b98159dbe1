"""Tests of pulsescale demo."""
