"""Ports for the servers kvflow starts: outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvflow import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= port < low for port in picked), picked
    assert len(picked) > 1, "the same port every time: two servers started together would clash"
    for port in picked:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_kernel_picks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine whose ephemeral range starts at 1024 leaves nothing below it to use.
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    port = ports.free_port()
    assert port >= 1024
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
