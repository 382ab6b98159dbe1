"""The `pulsescale` command: a thin dispatcher over the autoscaler, nodeagent and warmpool packages."""

__version__ = "0.1.0"
