"""Interface settings refused before the launch (app/distributed/launch.py): an interface gloo or NCCL
would not find on this node, and a run of several nodes where gloo would offer a loopback address."""

from __future__ import annotations

import re
import socket

import pytest

from app.distributed.launch import check_network_interfaces

NOT_LOCAL = "192.0.2.1"  # TEST-NET-1: an address of no machine, never loopback


@pytest.fixture(autouse=True)
def _no_interface_settings(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["lo", "lo,lo"])
def test_gloo_interfaces_that_exist_are_accepted(value, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    check_network_interfaces(NOT_LOCAL, num_nodes=2)  # named: gloo does not use the host name


@pytest.mark.parametrize("value, missing", [("nosuch0", "nosuch0"), ("lo,nosuch0", "nosuch0"), ("l", "l")])
def test_a_gloo_interface_this_node_lacks_is_refused(value, missing, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    message = f"^GLOO_SOCKET_IFNAME={value}: no interface {missing}: this node \\({re.escape(socket.gethostname())}\\) has lo"
    with pytest.raises(ValueError, match=message):
        check_network_interfaces("127.0.0.1", num_nodes=1)


@pytest.mark.parametrize("value", ["lo", "l", "=lo", "nosuch,lo", "^nosuch", "^lo"])
def test_nccl_interfaces_matching_one_of_this_node_or_excluding_are_accepted(value, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", value)
    check_network_interfaces("127.0.0.1", num_nodes=1)


@pytest.mark.parametrize("value", ["nosuch", "=l", "=nosuch0,=l"])
def test_an_nccl_interface_matching_none_of_this_node_is_refused(value, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", value)
    with pytest.raises(ValueError, match=f"^NCCL_SOCKET_IFNAME={value}: matches no interface: this node"):
        check_network_interfaces("127.0.0.1", num_nodes=1)


def test_several_nodes_where_gloo_would_offer_a_loopback_address_are_refused(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # as /etc/hosts' 127.0.1.1 <name>
    message = (
        "^gloo would offer the other 1 node\\(s\\) 127.0.0.1, a loopback address they cannot connect to "
        "\\(this node's host name 'localhost' resolves to it, or to nothing\\); set GLOO_SOCKET_IFNAME to the "
        f"interface that reaches {NOT_LOCAL} \\(this node \\(localhost\\) has lo"
    )
    with pytest.raises(ValueError, match=message):
        check_network_interfaces(NOT_LOCAL, num_nodes=2)
    check_network_interfaces(NOT_LOCAL, num_nodes=1)  # one node: gloo's peers are local
    check_network_interfaces("127.0.0.1", num_nodes=2)  # every "node" on this machine (the tests' launches)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    check_network_interfaces(NOT_LOCAL, num_nodes=2)  # named by the user


def test_several_nodes_where_the_host_name_is_routable_start(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: NOT_LOCAL)
    check_network_interfaces("198.51.100.7", num_nodes=2)
