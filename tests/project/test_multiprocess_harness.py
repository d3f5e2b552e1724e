"""tests/multiprocess.py's rendezvous: the port the ranks join is held by the test process from before
they start until the block ends, so no other process can take it in between (a port merely free when
chosen was, on a busy machine, now and then taken before rank 0 bound it, failing the test)."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.multiprocess import rendezvous_port


def test_the_rendezvous_port_is_held_for_the_whole_run_and_serves_the_ranks():
    with rendezvous_port() as port:
        with socket.socket() as thief, pytest.raises(OSError) as taken:
            thief.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        # A rank joins it as a client, as under torchrun's agent (TORCHELASTIC_USE_AGENT_STORE).
        rank = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        rank.set("joined", "rank0")
        assert rank.get("joined") == b"rank0"
