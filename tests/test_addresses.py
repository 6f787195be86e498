"""Where a peer listens and what it announces (swarm/net/addresses.py): options checked before anything starts."""

import socket

import pytest

from swarm.errors import UsageError
from swarm.net.addresses import check_port, network_overrides, tcp_port, unreachable_warning


def test_network_options_become_config_overrides():
    assert network_overrides(None, None) == []
    assert network_overrides(31337, None) == ["--swarm.host_maddrs", "/ip4/0.0.0.0/tcp/31337"]
    assert network_overrides(31337, "203.0.113.7") == ["--swarm.announce_maddrs", "/ip4/203.0.113.7/tcp/31337",
                                                       "--swarm.host_maddrs", "/ip4/0.0.0.0/tcp/31337"]
    chosen = network_overrides(None, "2001:db8::1")  # no --port: one is picked, for both
    port = chosen[1].rsplit("/", 1)[1]
    assert chosen == ["--swarm.announce_maddrs", f"/ip6/2001:db8::1/tcp/{port}", "--swarm.host_maddrs",
                      f"/ip4/0.0.0.0/tcp/{port}"]
    for bad, culprit in [(dict(port=-1), "--port -1"), (dict(port=None, announce_ip="1.2.3"), "'1.2.3'")]:
        with pytest.raises(UsageError, match=culprit):
            network_overrides(**{"announce_ip": None, **bad})


def test_a_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        with pytest.raises(UsageError, match=f"--port {taken.getsockname()[1]}: address already in use"):
            check_port(taken.getsockname()[1])


@pytest.mark.parametrize("maddrs, client, warns", [
    (["/ip4/127.0.0.1/tcp/5/p2p/Qm", "/ip4/192.168.1.4/tcp/5/p2p/Qm"], False, True),
    (["/ip4/10.0.0.2/tcp/5", "/ip6/fd00::2/tcp/5"], False, True),
    (["/ip4/127.0.0.1/tcp/5", "/ip4/8.8.8.8/tcp/5"], False, False),  # one public address is enough
    (["/ip4/10.0.0.2/tcp/5"], True, False),  # a client is never dialed
])
def test_a_peer_that_announces_no_public_address_is_warned(maddrs, client, warns):
    warning = unreachable_warning(maddrs, client)
    assert (warning is not None) == warns
    if warns:
        assert "--announce-ip" in warning and "--client-mode" in warning and "TCP port 5" in warning
    assert tcp_port(maddrs) == 5
    if warns:  # a bootstrap has no client mode to fall back on
        assert "--client-mode" not in unreachable_warning(maddrs, client, can_be_client=False)


def test_the_readme_s_example_address_is_named_as_an_example_not_a_private_one():
    """`--announce-ip 203.0.113.7` as the README writes it: the warning said to pass --announce-ip, which the user
    had; it now says that the address is an example's."""
    warning = unreachable_warning(["/ip4/203.0.113.7/tcp/31338", "/ip4/127.0.0.1/tcp/31338"], False)
    assert warning == ("this peer announces 203.0.113.7, an address reserved for documentation (RFC 5737, RFC 3849) "
                       "that nobody can dial: pass --announce-ip with this machine's public IP, and open TCP port "
                       "31338")
