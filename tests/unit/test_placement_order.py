"""Training ranks are numbered node by node, the controller's node first (megarl.actors.placement.rank_order)."""
from megarl.actors.placement import rank_order

IPS = {"a": "10.0.0.2", "b": "10.0.0.10", "c": "10.0.0.9"}


def test_ranks_follow_nodes_with_the_controllers_first():
    # Ray's PACK put bundles 0, 2 on node b, 1, 3 on node a; the controller runs on node b
    assert rank_order({0: "b", 1: "a", 2: "b", 3: "a"}, 4, here="b", ips=IPS) == [0, 2, 1, 3]
    # the controller on a node without bundles (a CPU-only head): nodes by address, numerically
    assert rank_order({0: "b", 1: "c", 2: "a", 3: "b"}, 4, here="z", ips=IPS) == [2, 1, 0, 3]


def test_extra_bundles_are_not_ranks():
    # split placement: bundles beyond world_size belong to the engines
    assert rank_order({0: "a", 1: "b", 2: "a"}, 2, here="b", ips=IPS) == [1, 0]


def test_rendezvous_port_is_free_and_below_the_ephemeral_range(tmp_path):
    """rank 0's port must not be one the kernel hands to outgoing connections (EADDRINUSE at
    process-group creation when one takes it first); a port in use is skipped."""
    import random
    import socket

    from megarl.actors.placement import _ephemeral_low, _free_port

    low = _ephemeral_low()
    port = _free_port("127.0.0.1", random.Random(0))
    assert 20000 <= port < low
    with socket.socket() as held:   # the same draw with that port taken gives another, still below the range
        held.bind(("127.0.0.1", port))
        held.listen()
        other = _free_port("127.0.0.1", random.Random(0))
        assert other != port and 20000 <= other < low
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t60999\n")
    assert _ephemeral_low(str(ranges)) == 1024
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
