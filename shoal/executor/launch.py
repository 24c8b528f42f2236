"""The worker processes rank 0 starts on its own machine (and `shoal worker` on others), and how they are stopped.

On Linux a worker is forked from a zygote that has already imported what a rank runs (executor/zygote.py):
a fresh interpreter took about 3 s of CPU per rank before it could meet the group. Elsewhere it is a fresh
`python -m shoal.executor.worker`."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from shoal.config import EngineConfig
from shoal.executor import zygote

log = logging.getLogger("shoal.executor")
FORK_WORKERS = sys.platform == "linux"  # from a zygote (fork is safe there before torch runs anything); else exec


@dataclass(eq=False)
class Worker:
    """A started rank's process."""

    rank: int
    proc: subprocess.Popen | zygote.ForkedProcess
    stopping: bool = False  # its exit is our doing (stop_workers): not worth an error line

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()


def start_workers(config: EngineConfig, port: int) -> list[Worker]:
    """The other ranks of rank 0's machine, started (and watched) by rank 0."""
    par = config.parallel
    workers = [spawn_worker(r, par.world_size, par.master_addr, port, par.timeout) for r in range(1, par.ranks_per_node)]
    _watch(workers)
    return workers


def spawn_worker(rank: int, size: int, addr: str, port: int, timeout: float, rejoin: bool = False) -> Worker:
    """`rejoin`: after losing the group, meet it again (a machine's own ranks under --restart-workers)."""
    args = ["--world-size", str(size), "--master-addr", addr, "--master-port", str(port), "--timeout", str(timeout),
            *(["--rejoin"] if rejoin else []), "--rank", str(rank)]
    if FORK_WORKERS:
        return Worker(rank, zygote.spawn("shoal.executor.worker", args))
    return Worker(rank, subprocess.Popen([sys.executable, "-m", "shoal.executor.worker", *args], stdin=subprocess.DEVNULL))


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        w.stopping = True
        w.kill()
        w.wait()


def _watch(workers: list[Worker]) -> None:
    """Say at once when a started rank dies (rank 0 would otherwise wait for it until the timeout)."""

    def watch():
        for w in workers:
            code = w.wait()
            if code and not w.stopping:
                log.error("rank %d (a worker process) exited with code %d", w.rank, code)

    threading.Thread(target=watch, name="shoal-tp-watch", daemon=True).start()
