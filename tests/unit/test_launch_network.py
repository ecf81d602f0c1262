"""Host role, node address and socket interface for a multi-node c10d rendezvous; restart setting."""

from __future__ import annotations

import os

import pytest

from meshrun.launch.args import build_parser
from meshrun.launch.network import (
    NodeNetwork,
    interface_addresses,
    interface_of,
    loopback_network,
    node_network,
    route_source,
    worker_socket_env,
)
from meshrun.launch.spec import launch_spec


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


def test_multinode_plan_sets_address_and_interface_but_keeps_user_settings(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    args = build_parser().parse_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                      "127.0.0.1:29999", "x.py"])
    plan = launch_spec(args)
    assert plan.options.local_addr == "127.0.0.1" and plan.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert "NCCL_SOCKET_IFNAME" not in plan.env  # the user's ib0 stays
    assert args.local_addr is None and "GLOO_SOCKET_IFNAME" not in os.environ  # planning changes nothing
    single = launch_spec(build_parser().parse_args(["--nnodes", "1", "--local-addr", "h", "x.py"]))
    assert single.options.local_addr == "h" and single.network == loopback_network()  # the user's address stays


def test_single_node_plan_is_loopback_only(monkeypatch):
    """One node: MASTER_ADDR (via --local-addr) and gloo/NCCL on loopback, unless the user chose."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    plan = launch_spec(build_parser().parse_args(["--nproc-per-node", "2", "x.py"]))
    assert plan.options.local_addr == "127.0.0.1"
    assert plan.env["GLOO_SOCKET_IFNAME"] == plan.env["NCCL_SOCKET_IFNAME"] == interface_of("127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    assert "GLOO_SOCKET_IFNAME" not in launch_spec(build_parser().parse_args(["x.py"])).env


def test_restart_setting_is_set_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    args = build_parser().parse_args(["--nproc-per-node", "1", "x.py"])
    assert launch_spec(args).env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch_spec(args).env
