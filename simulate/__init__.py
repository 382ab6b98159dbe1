"""`pulsescale simulate`: a discrete-event simulation of the gateway queue and the replicas, in which our real
policy (`autoscaler.decide.policy.decide`) and HPA v2, KEDA and Knative KPA (from their documented algorithms) face the
same pulse. Pure: no NATS, no HTTP, no clock; `simulate.cli` is the command."""

from simulate.engine import Result, Service, Startup, run
from simulate.scenarios import SCENARIOS, Scenario, make

__all__ = ["SCENARIOS", "Result", "Scenario", "Service", "Startup", "make", "run"]
