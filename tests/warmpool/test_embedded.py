"""The embedded nats-server picks its ports again when another process takes one before it binds (CI saw
"address already in use" under parallel tests), and keeps given ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from warmpool.embedded import NatsServer, PortTaken, free_port


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_picked_port_taken_before_start_is_picked_again(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    taken_client, taken_monitor = server.port, server.monitor_port
    assert taken_monitor is not None
    holds = [_hold(taken_client), _hold(taken_monitor)]
    try:
        server.start()
        try:
            assert server.port != taken_client and server.monitor_port != taken_monitor
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as c:
                assert c.recv(5) == b"INFO "
        finally:
            server.stop()
    finally:
        for s in holds:
            s.close()


def test_a_given_port_that_is_taken_fails_naming_the_cause(tmp_path: Path) -> None:
    port = free_port()
    hold = _hold(port)
    try:
        server = NatsServer(tmp_path / "nats", port=port, monitor_port=None)
        with pytest.raises(PortTaken, match="address already in use"):
            server.start()
        assert server.port == port
        server.stop()
    finally:
        hold.close()


def test_free_port_stays_below_the_kernels_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    if low > 11000:
        assert all(p < low for p in ports)
    assert len(ports) > 1


def test_a_restart_keeps_its_ports_and_says_when_one_was_taken(tmp_path: Path) -> None:
    """After a first start the ports are the server's: clients hold its URL, so a restart that finds its port
    taken fails loudly instead of moving to another."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        port = server.port
        server.kill()
        hold = _hold(port)
        try:
            with pytest.raises(PortTaken) as taken:
                server.start()
            assert taken.value.port == port and server.port == port
        finally:
            hold.close()
        server.start()  # the port is free again: the same one
        assert server.port == port
    finally:
        server.stop()


def test_a_cluster_server_whose_client_port_was_taken_before_its_bind_starts_on_another(tmp_path: Path) -> None:
    """The servers of a test cluster are launched together, without `start`'s retry: a client port taken in
    between failed a serial run (`pytest -m serial`) once. That server alone is launched again on another port."""
    from tests.cluster_helpers import NatsCluster

    cluster = NatsCluster(tmp_path / "cluster")
    taken = cluster.servers[1].port
    hold = _hold(taken)
    try:
        with cluster:  # returns once all three agree on a meta leader
            assert cluster.servers[1].port != taken
            assert cluster.servers[1].proc is not None and cluster.servers[1].proc.poll() is None
    finally:
        hold.close()
