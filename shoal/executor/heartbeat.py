"""Heartbeats: every rank but 0 counts one in rank 0's TCP store twice a second, from a thread of its own, so a
rank that is stopped, cut off or stuck stops counting; rank 0's HeartbeatWatch reads the counts, and a rank
whose count has not moved for --heartbeat-timeout seconds is lost: the group's waits give up. When no step
has gone out for HEARTBEAT_S, rank 0 broadcasts HEARTBEAT instead (the workers skip it), so that a lost rank
shows while the server is idle."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shoal.executor.group import RankGroup, first_line

log = logging.getLogger("shoal.executor")
HEARTBEAT = "heartbeat"  # what rank 0 broadcasts when no step has gone out for HEARTBEAT_S (workers skip it)
HEARTBEAT_S = 2.0
BEAT_S = 0.5  # how often the other ranks count their heartbeat in rank 0's store


def start_beating(group: RankGroup) -> Callable[[], None]:
    """A rank other than 0: count this process's heartbeat in rank 0's store every BEAT_S, from a thread of
    its own (HeartbeatWatch reads the counts), until the function returned is called. The rank calls it
    before it exits: a thread left inside a store call while the interpreter shuts down aborts the process."""
    stopped = threading.Event()

    def beat() -> None:
        key = f"shoal/beat/{group.rank}"
        while not stopped.is_set():
            try:
                store = group.store_client()
                while not stopped.is_set():
                    store.add(key, 1)
                    stopped.wait(BEAT_S)
            except Exception as e:  # noqa: BLE001 (rank 0 unreachable: connect again; the steps' collectives say what broke)
                log.debug("rank %d: heartbeat not counted (%s)", group.rank, first_line(e))
                stopped.wait(BEAT_S)

    thread = threading.Thread(target=beat, name="shoal-heartbeat", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=4 * BEAT_S)  # a beat fails fast once rank 0 has closed its store

    return stop


class HeartbeatWatch:
    """Rank 0's watch over the other ranks' heartbeats (RankGroup.start_beating): a rank whose count has not
    moved for `timeout` seconds is hung (stopped, cut off, stuck in a call), and the group's waits give up."""

    def __init__(self, group: RankGroup, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.silent: int | None = None  # the rank found hung
        self.lost: str | None = None  # why the ranks are taken for lost; the group's waits give up while it is set
        self.active = True  # False while the ranks restart (they load before they count again)
        self._seen: dict[int, tuple[int, float]] = {}  # rank: (count, when it last moved)
        self._stop = threading.Event()
        group.poll_waits(lambda: self.lost)
        threading.Thread(target=self._run, name="shoal-heartbeat-watch", daemon=True).start()

    def pause(self) -> None:
        """While the ranks restart: no verdict (they load before they count again), and none standing."""
        self.active, self.lost = False, None

    def reset(self) -> None:
        """After a restart: every rank's silence is timed from now."""
        self._seen, self.silent, self.lost = {}, None, None
        self.active = True

    def _run(self) -> None:
        store = None
        while not self._stop.wait(BEAT_S):
            try:
                store = store or self.group.store_client()
                counts = {r: store.add(f"shoal/beat/{r}", 0) for r in range(1, self.group.size)}
            except Exception as e:  # noqa: BLE001 (the store is this process's: a hiccup, try again)
                log.debug("heartbeat counts not read (%s)", first_line(e))
                store = None
                continue
            self.check(counts, time.monotonic())

    def check(self, counts: dict[int, int], now: float) -> None:
        """One look at the ranks' counts at monotonic time `now`."""
        if not self.active:  # reset() starts the timing again
            return
        for rank, count in counts.items():
            seen = self._seen.get(rank)
            if seen is None or seen[0] != count:
                self._seen[rank] = (count, now)
            elif now - seen[1] > self.timeout and self.lost is None:
                self.silent = rank
                self.lost = f"rank {rank} sent no heartbeat for {now - seen[1]:.0f} s (stopped, hung or cut off)"
                log.error("%s: the steps waiting on it give up", self.lost)

    def close(self) -> None:
        self._stop.set()
