"""Free TCP ports for the servers kvflow starts on this machine, outside the ephemeral range.

A port handed out by binding port 0 comes from the kernel's ephemeral range, the range every
outgoing connection takes its local port from. Between the pick and the server's own bind,
an HTTP or gRPC client of any process can take it, and the server fails to start with
"address already in use". A port below that range is given to no outgoing connection, so
only another explicit bind can take it in between.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux keeps the range of ports it gives outgoing connections."""
DEFAULT_EPHEMERAL_LOW = 32768
"""The range's first port where the file cannot be read (Linux's default)."""
LOWEST = 20000
"""Below this, ports are left to services people run on their own (databases, UIs)."""
_TRIES = 50


def _ephemeral_low() -> int:
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
    return low


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free right now, below the ephemeral range where it can.

    Falls back to a port the kernel picks (in that range) where the range starts too low
    to leave room, or where no port tried below it was free.
    """
    low = _ephemeral_low()
    if low - 1 > LOWEST:
        for _ in range(_TRIES):
            port = random.randint(LOWEST, low - 1)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked
