"""A rank about to kill itself waits until the driver holds its queued reports (ReportChannel)."""

from __future__ import annotations

import threading
import time

from workers.reporting import NullChannel, ReportChannel


def test_wait_delivered_returns_once_the_poll_after_the_one_that_took_the_reports_came():
    channel = ReportChannel(rank=0)
    channel.log(level="info", logger="t", message="step 9 done")
    drained: list[tuple[float, int]] = []

    def driver() -> None:  # polls every 200 ms, as the controller does every 250 ms
        for _ in range(3):
            time.sleep(0.2)
            drained.append((time.monotonic(), len(channel.drain())))

    poller = threading.Thread(target=driver)
    poller.start()
    assert channel.wait_delivered(timeout_s=5) is True
    returned = time.monotonic()
    poller.join()
    assert [count for _, count in drained] == [1, 0, 0]  # the first poll carried the report
    # the wait ended with the driver's next poll, not with the one that took the report
    assert drained[0][0] < returned < drained[2][0]


def test_wait_delivered_gives_up_after_its_timeout_when_nobody_polls():
    channel = ReportChannel(rank=0)
    channel.log(level="info", logger="t", message="unpolled")
    started = time.monotonic()
    assert channel.wait_delivered(timeout_s=0.2) is False
    assert 0.2 <= time.monotonic() - started < 2


def test_a_channel_that_drops_reports_never_waits():
    assert NullChannel().wait_delivered(timeout_s=60) is True
