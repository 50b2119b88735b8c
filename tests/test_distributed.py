"""``ray_hsdp.distributed``: the group's rendezvous."""

from __future__ import annotations

import socket

import pytest

from ray_hsdp.distributed import bind_rendezvous, connect_rendezvous


def test_the_rendezvous_port_is_held_from_its_pick_to_the_rendezvous():
    """Issue 74: rank 0 binds its store on a port the system picks and hands that port out; no
    other process can bind it meanwhile (a port found free and bound later could be taken: the
    group then respawned every rank)."""
    store = bind_rendezvous("127.0.0.1", 2, timeout_s=10)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))
    client = connect_rendezvous("127.0.0.1", store.port, 2, timeout_s=10)
    client.set("rank 1", "joined")
    assert store.get("rank 1") == b"joined"
