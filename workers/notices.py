"""Notices that something of this rank is about to go away: its machine (a cloud
instance-action endpoint) or its process (SIGTERM).

Runs on every rank actor. Both end up as one ``drain_notice`` report on the rank's channel,
scoped (``NoticeScope``): the driver drains the node's replica groups at the next step
boundary for a machine notice, and only the rank's own replica group (its actor retired) for a
signal to its process. Ray's own node draining (autoscaler, ``ray drain-node``, a pod's preStop
hook) is read by the driver itself.
"""

from __future__ import annotations

import logging
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger("meshpilot.rank")


def watch_sigterm(on_notice: Callable[[str], None]) -> bool:
    """Turn SIGTERM into a notice that this process goes away, instead of an exit; call from the
    process's main thread. The notice is about this process only: a signal to one process says
    nothing of the node (Ray's own draining, or a cloud notice, says that)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, lambda signum, frame: on_notice("SIGTERM"))
    return True


class InstanceActionWatcher:
    """Polls the instance-action URL in a daemon thread; reports the first notice once."""

    def __init__(self, url: str, *, interval_s: float, on_notice: Callable[[str], None]) -> None:
        self.url = url
        self.interval_s = interval_s
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="instance-action", daemon=True)

    def start(self) -> InstanceActionWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            notice = self.check()
            if notice is not None:
                self.on_notice(notice)
                return

    def check(self) -> str | None:
        """The notice text if the endpoint announces an action (HTTP 200), else None."""
        try:
            with urllib.request.urlopen(self.url, timeout=min(2.0, self.interval_s)) as response:
                if response.status == 200:
                    body = response.read(4096).decode("utf-8", "replace").strip()
                    return f"instance action: {body or 'notice'}"
        except urllib.error.HTTPError as error:
            if error.code != 404:  # 404 is the normal "nothing scheduled" answer
                log.debug("instance-action endpoint answered %s", error.code)
        except (urllib.error.URLError, OSError, ValueError) as error:
            log.debug("instance-action endpoint unreachable: %s", error)
        return None
