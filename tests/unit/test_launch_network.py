"""Host role, node address and socket interface for a multi-node c10d rendezvous; restart setting."""

from __future__ import annotations

import os

import pytest

from meshrun.launch import launcher
from meshrun.launch.args import build_parser
from meshrun.launch.network import (
    NodeNetwork,
    interface_addresses,
    node_network,
    route_source,
    worker_socket_env,
)


def _own_non_loopback_address() -> tuple[str, str] | None:
    for name, addrs in interface_addresses().items():
        for addr in addrs:
            if "." in addr and not addr.startswith("127."):
                return name, addr
    return None


def test_loopback_endpoint_keeps_torchs_host_guess_and_uses_lo():
    net = node_network("127.0.0.1", 29400, port_bound_here=False)
    assert net == NodeNetwork(is_host=None, local_addr="127.0.0.1", ifname="lo")


def test_own_address_makes_this_node_the_host_unless_the_port_is_taken():
    own = _own_non_loopback_address()
    if own is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, addr = own
    assert route_source(addr, 29400) == addr
    assert node_network(addr, 29400, port_bound_here=False) == NodeNetwork(True, addr, name)
    # A second agent on the same host: the store is already there, so it must join as a client.
    assert node_network(addr, 29400, port_bound_here=True).is_host is None


def test_foreign_address_is_not_the_host():
    net = node_network("198.51.100.55", 29400, port_bound_here=False)  # TEST-NET-2: not ours
    assert net.is_host is None


def test_user_interface_choice_wins():
    net = NodeNetwork(None, "10.0.0.2", "eth1")
    assert worker_socket_env(net, {}) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert worker_socket_env(net, {"GLOO_SOCKET_IFNAME": "ib0"}) == {"NCCL_SOCKET_IFNAME": "eth1"}
    assert worker_socket_env(NodeNetwork(None, None, None), {}) == {}


def test_multinode_launch_sets_address_and_interface_but_keeps_user_settings(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")  # recorded, so that teardown restores it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    args = build_parser().parse_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                      "127.0.0.1:29999", "x.py"])
    launcher._configure_network(args)
    assert args.local_addr == "127.0.0.1" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    single = build_parser().parse_args(["--nnodes", "1", "--local-addr", "h", "x.py"])
    launcher._configure_network(single)
    assert single.local_addr == "h"


def test_restart_setting_is_set_unless_the_user_chose(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "unset")  # recorded for teardown
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    launcher._reliable_restarts()
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    launcher._reliable_restarts()
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"
