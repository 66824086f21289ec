"""sd_notify: datagrams on $NOTIFY_SOCKET, and the watchdog period from systemd's variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from borrowd.controller.sdnotify import Notifier, watchdog_interval_s


def test_notify_sends_one_datagram_to_the_socket(tmp_path: Path) -> None:
    """READY=1 and STATUS reach a listener on NOTIFY_SOCKET as one newline-joined message."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        assert notifier.notify("READY=1", "STATUS=ticking")
        assert listener.recv(4096) == b"READY=1\nSTATUS=ticking"


def test_abstract_socket_name_is_supported() -> None:
    """A NOTIFY_SOCKET starting with @ names a Linux abstract socket."""
    name = f"borrowd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).notify("WATCHDOG=1")
        assert listener.recv(4096) == b"WATCHDOG=1"


def test_notify_never_blocks_on_a_listener_that_stopped_reading(tmp_path: Path) -> None:
    """With the listener's queue full, notify returns False at once instead of blocking."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        results = [notifier.notify("WATCHDOG=1") for _ in range(5000)]
    assert results[0] is True
    assert results[-1] is False


@pytest.mark.parametrize(
    ("environ", "sent"),
    [({}, False), ({"NOTIFY_SOCKET": "/nonexistent/borrowd.sock"}, False)],
    ids=["not-under-systemd", "socket-gone"],
)
def test_notify_without_listener_is_a_quiet_no(environ: dict, sent: bool) -> None:
    """Outside systemd, or with the socket gone, notify returns False and raises nothing."""
    assert Notifier(environ).notify("READY=1") is sent


@pytest.mark.parametrize(
    ("environ", "interval_s"),
    [
        ({"WATCHDOG_USEC": "15000000"}, 15.0),
        ({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
    ids=["set", "for-this-pid", "for-another-pid", "zero", "garbage", "unset"],
)
def test_watchdog_interval_from_environment(environ: dict, interval_s: float | None) -> None:
    """WatchdogSec arrives as WATCHDOG_USEC (for WATCHDOG_PID when given)."""
    assert watchdog_interval_s(environ) == interval_s
