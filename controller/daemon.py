"""The daemon's scheduler: every pool's `PoolLoop` ticked on wall time until told to stop.

`Daemon` runs the loops on an APScheduler (no overlapping ticks, overruns and misfires logged
and counted), tells systemd it is ready and alive, and on SIGTERM stops ticking and releases
its leader leases. The loop itself is `controller.loop`; the wiring of Redis, Prometheus,
logging and the metrics server is the CLI's (`controller.cli.daemon`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobEvent,
    JobExecutionEvent,
)
from apscheduler.schedulers.background import BackgroundScheduler
from borrowd.controller.loop import PoolLoop
from borrowd.controller.loop_metrics import DaemonMetrics
from borrowd.controller.sdnotify import Notifier
from borrowd.models.protocols import Clock


class WallClock:
    """Unix time, the time base of budgets and Prometheus queries (a `Clock`)."""

    def now_s(self) -> float:
        """Current Unix time in seconds."""
        return time.time()


class Daemon:
    """Runs every pool's loop on a scheduler until `stop` is set (SIGTERM / SIGINT).

    Ticks of one pool never overlap (`max_instances=1`); a tick that is still running when the
    next is due makes the scheduler skip that one (counted as an overrun), and late runs are
    coalesced into one (counted as a misfire). systemd gets READY=1 once ticking, WATCHDOG=1
    while every pool ticked within three periods, and STOPPING=1 on the way out.
    """

    def __init__(
        self,
        loops: Mapping[str, PoolLoop],
        tick_s: Mapping[str, float],
        *,
        metrics: DaemonMetrics,
        clock: Clock | None = None,
        notifier: Notifier | None = None,
        log: Any = None,
    ) -> None:
        self.loops = dict(loops)
        self.tick_s = dict(tick_s)
        self.metrics = metrics
        self.clock: Clock = clock or WallClock()
        self.notifier = notifier or Notifier({})
        self.log = log or structlog.get_logger("borrowd.daemon")
        self.started_s = self.clock.now_s()
        self.scheduler = BackgroundScheduler(
            timezone="UTC",
            job_defaults={"max_instances": 1, "coalesce": True},
        )
        self.scheduler.add_listener(
            self._on_event, EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES | EVENT_JOB_ERROR
        )

    def start(self) -> None:
        """Schedule every pool's tick (the first one now) and tell systemd we are ready."""
        for pool, loop in self.loops.items():
            self.scheduler.add_job(
                self._run_tick, "interval", seconds=self.tick_s[pool], args=[loop], id=pool,
                name=f"tick {pool}", misfire_grace_time=max(1, int(self.tick_s[pool])),
                next_run_time=datetime.now(UTC),
            )
        self.scheduler.start()
        self.notifier.notify("READY=1", f"STATUS=ticking {len(self.loops)} pool(s)")
        self.log.info("daemon_started", pools=sorted(self.loops),
                      watchdog_s=self.notifier.watchdog_s)

    def run_until(self, stop: threading.Event) -> None:
        """Start, ping the watchdog while healthy, and shut down cleanly once `stop` is set."""
        self.start()
        period_s = min(self.tick_s.values())
        if self.notifier.watchdog_s:
            period_s = min(period_s, self.notifier.watchdog_s / 2)
        try:
            while not stop.wait(period_s):
                if self.notifier.watchdog_s and self.healthy(self.clock.now_s()):
                    self.notifier.notify("WATCHDOG=1")
        finally:
            self.shutdown()

    def healthy(self, now_s: float) -> bool:
        """True while every pool finished a tick within three of its periods."""
        for pool, loop in self.loops.items():
            last = loop.last_tick_done_s if loop.last_tick_done_s is not None else self.started_s
            if now_s - last > 3 * self.tick_s[pool]:
                return False
        return True

    def shutdown(self) -> None:
        """Stop ticking (waiting for running ticks), then release every leader lease."""
        self.notifier.notify("STOPPING=1")
        self.log.info("daemon_stopping")
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        for loop in self.loops.values():
            loop.shutdown()
        self.log.info("daemon_stopped")

    def _run_tick(self, loop: PoolLoop) -> None:
        # An exception here reaches `_on_event` as EVENT_JOB_ERROR; the job keeps its schedule,
        # and the budget's lease closes batch work if ticks keep failing.
        loop.tick(self.clock.now_s())

    def _on_event(self, event: JobEvent) -> None:
        pool = event.job_id
        if event.code == EVENT_JOB_MAX_INSTANCES:
            self.metrics.errors.labels(pool, "scheduler", "overrun").inc()
            self.log.warning("tick_overrun", pool=pool,
                             detail="previous tick still running; this one skipped")
        elif event.code == EVENT_JOB_MISSED:
            self.metrics.errors.labels(pool, "scheduler", "misfire").inc()
            scheduled = getattr(event, "scheduled_run_time", None)
            self.log.warning("tick_misfire", pool=pool,
                             scheduled=scheduled.isoformat() if scheduled else None)
        elif isinstance(event, JobExecutionEvent) and event.exception is not None:
            self.metrics.errors.labels(pool, "policy", type(event.exception).__name__).inc()
            self.log.error("tick_failed", pool=pool, error=repr(event.exception),
                           traceback=event.traceback)
