"""The zygote that forks worker ranks (shoal/executor/zygote.py), with a probe module in place of a rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shoal.executor import zygote

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked from a zygote on Linux only")

PROBE = '''
import json, os, sys, time

def main(argv):
    out, how = argv
    with open(out, "w") as f:
        json.dump({"probe": os.environ.get("ZYGOTE_PROBE"), "cwd": os.getcwd(), "ppid": os.getppid(),
                   "stdin": os.read(0, 1).decode()}, f)
    if how == "sleep":
        time.sleep(120)
    if how == "raise":
        raise ValueError("the probe failed")
    return int(how)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """A module the zygote can import (its folder on PYTHONPATH: a zygote of its own, shared by this file's
    tests), and a spawner of it."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "zygote_probe.py").write_text(PROBE)
    runs = iter(range(1000))

    def run(how: str) -> tuple[zygote.ForkedProcess, object]:
        out = folder / f"run{next(runs)}.json"
        proc = zygote.spawn("zygote_probe", [str(out), how])

        def seen() -> dict:
            deadline = time.monotonic() + 30
            while not out.exists() or not out.read_text():
                assert time.monotonic() < deadline, "the probe never ran"
                time.sleep(0.02)
            return json.loads(out.read_text())

        return proc, seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(folder))
        mp.setattr(zygote, "PRELOAD", False)  # a probe needs none of a rank's imports (the parallel tests fork ranks)
        yield run
        for z in [z for z in zygote._zygotes if ("PYTHONPATH", str(folder)) in z.key[0]]:  # every probe's zygote
            zygote._zygotes.remove(z)
            z.close()


def _current() -> zygote.Zygote:
    (z,) = [z for z in zygote._zygotes if z.key == zygote._key(os.environ, os.getcwd())]
    return z


def test_a_forked_process_runs_with_the_starters_environment_and_gives_its_exit_code(probe, monkeypatch):
    monkeypatch.setenv("ZYGOTE_PROBE", "first")
    proc, seen = probe("3")
    assert proc.wait(timeout=30) == 3 and proc.poll() == 3 and proc.returncode == 3
    first = seen()
    assert first["probe"] == "first" and first["cwd"] == os.getcwd() and first["stdin"] == ""  # stdin is /dev/null
    assert first["ppid"] != os.getpid()  # a child of the zygote, not of this process
    # a variable no import reads: set in the child, from the same zygote
    monkeypatch.setenv("ZYGOTE_PROBE", "second")
    proc, seen = probe("0")
    assert proc.wait(timeout=30) == 0
    assert seen()["probe"] == "second" and seen()["ppid"] == first["ppid"]
    # a main that raises exits with 1 (its traceback goes to stderr)
    proc, _ = probe("raise")
    assert proc.wait(timeout=30) == 1


def test_wait_times_out_kill_is_a_signal_and_closing_the_zygote_ends_its_processes(probe):
    proc, seen = probe("sleep")
    seen()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # after its end: nothing to do, as with Popen

    proc, seen = probe("sleep")
    seen()
    z = _current()
    assert z.live_children() == 1
    z.close()  # as when the starter exits: the zygote reads the end of its input
    assert proc.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    with pytest.raises(RuntimeError, match="zygote"):
        z.spawn("zygote_probe", ["x", "0"])
    proc, seen = probe("0")  # the next spawn starts a zygote again
    assert proc.wait(timeout=30) == 0 and seen()["ppid"] == _current().proc.pid != z.proc.pid


def test_a_variable_read_at_import_gets_a_zygote_of_its_own(probe, monkeypatch):
    proc, seen = probe("0")
    assert proc.wait(timeout=30) == 0
    before = _current()
    assert seen()["ppid"] == before.proc.pid
    monkeypatch.setenv("SHOAL_ZYGOTE_PROBE_SETTING", "1")  # SHOAL_*: what shoal's imports may read
    proc, seen = probe("0")
    assert proc.wait(timeout=30) == 0
    assert seen()["ppid"] == _current().proc.pid != before.proc.pid
    assert before not in zygote._zygotes and before.proc.returncode is not None  # closed: no process of its was left
    monkeypatch.delenv("SHOAL_ZYGOTE_PROBE_SETTING")


def test_an_idle_zygote_exits_and_the_next_spawn_starts_another(probe):
    proc, seen = probe("0")
    assert proc.wait(timeout=30) == 0
    z = _current()
    idle = zygote.Zygote(dict(os.environ), os.getcwd(), idle_s=0.5, preload=False)
    with zygote._zygotes_lock:
        zygote._zygotes[zygote._zygotes.index(z)] = idle
    z.close()
    assert idle.proc.wait(timeout=30) == 0  # no process of its for half a second: it exits by itself
    with pytest.raises(RuntimeError, match="zygote"):
        idle.spawn("zygote_probe", ["x", "0"])
    proc, seen = probe("0")  # the module's spawn drops it and starts another
    assert proc.wait(timeout=30) == 0 and seen()["ppid"] == _current().proc.pid != idle.proc.pid
