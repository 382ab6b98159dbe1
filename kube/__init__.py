"""The Kubernetes side of pulsescale: the kopf operator for ScaledObject CRs, standby pods, the cold path
(the target's scale subresource) and leader election over a Kubernetes Lease. Only `pulsescale operator` imports it."""
