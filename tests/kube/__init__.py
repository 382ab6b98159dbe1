"""Tests of the Kubernetes side: operator, RBAC, deploy/, monitoring."""
