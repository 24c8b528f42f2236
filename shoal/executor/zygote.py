"""Worker ranks forked from a process that has already imported what a rank runs.

A fresh interpreter spends about 3 s of CPU importing torch, transformers and shoal's runner before a rank can
meet its group. Every rank that rank 0 starts on its machine paid it: at start, at each `--restart-workers`
restart, and at each load of a tensor- or pipeline-parallel model in a several-models server. The zygote pays
it once per process that starts ranks: that process starts it the first time it needs a worker, and each worker
is then a fork of it (a few milliseconds), given the starter's environment and working directory of the moment,
its standard input on /dev/null as before. The ranks share the zygote's pages of the imported code.

Nothing runs in the zygote but its imports: no thread pool, no tensor, no Python thread, so a fork starts from
a clean state. What a rank reads from the environment when torch or shoal is imported (SHOAL_CPU_ISA and
the instruction caps it sets, thread counts) was read in the zygote, so a zygote serves one environment and
working directory: a starter whose environment changed gets a new zygote (`spawn`).

The protocol, on two pipes: the starter writes one JSON line per process, {"module", "argv", "env", "cwd"}: run
MODULE.main(ARGV) and exit with what it returns (shoal.executor.worker for a rank); the zygote
answers {"pid"} for each, in order, and {"exit": pid, "code": code} when one ends (Popen's convention: -N for a
signal). At the end of its input (the starter closed it, or died) the zygote kills the ranks it forked, which
serve no one then, and exits. With no rank left for IDLE_S it exits too, giving back the ~230 MB its imports
hold (a several-models server that unloaded its parallel model); the next spawn starts another.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback


class ForkedProcess:
    """A worker forked by a zygote: what subprocess.Popen offers the launcher (pid, poll, wait, kill)."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid, self.args = pid, argv
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # its exit not yet reported: the pid is still this worker's (or, for the moment
            # between the zygote's reaping and its report, nobody's: pids are not reused that fast)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The starter's side: one zygote process, and the workers it forked."""

    def __init__(self, env: dict[str, str], cwd: str, idle_s: float | None = None, preload: bool = True) -> None:
        """idle_s: how long it may go without a process of its before it exits (IDLE_S); preload: import what a
        rank runs first (False only where it forks something else: the tests' probes)."""
        self.key = _key(env, cwd)
        req_r, self._req = os.pipe()
        rep_r, rep_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "shoal.executor.zygote", str(req_r), str(rep_w),
                                      str(idle_s or IDLE_S), "preload" if preload else "bare"],
                                     pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        os.close(req_r)
        os.close(rep_w)
        self._replies: queue.Queue = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}  # the forked processes whose exit has not come back
        self._lock = threading.Lock()  # one spawn at a time: the pid replies come in request order
        self._pending: list[list[str]] = []  # argv of the spawns waiting for their pid, oldest first
        self.closed = False
        self._reader = threading.Thread(target=self._read, args=(rep_r,), name="shoal-zygote-reader", daemon=True)
        self._reader.start()

    def spawn(self, module: str, argv: list[str]) -> ForkedProcess:
        with self._lock:
            if self.closed:
                raise RuntimeError("the worker launcher (zygote) has exited")
            self._pending.append([sys.executable, "-m", module, *argv])
            msg = {"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
            try:
                os.write(self._req, (json.dumps(msg) + "\n").encode())
            except OSError:
                self.closed = True
            while True:
                try:
                    got = self._replies.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self.closed and not self._reader.is_alive() and self._replies.empty():
                        got = RuntimeError("the worker launcher (zygote) exited before it started the worker")
                        break
        if isinstance(got, BaseException):
            raise got
        return got

    def live_children(self) -> int:
        return len(self._children)

    def close(self) -> None:
        """End the zygote; the workers it forked are killed (the caller has stopped them)."""
        self.closed = True
        try:
            os.close(self._req)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as replies:
            for line in replies:
                msg = json.loads(line)
                if "pid" in msg:
                    child = ForkedProcess(msg["pid"], self._pending.pop(0))
                    self._children[child.pid] = child
                    self._replies.put(child)
                else:
                    child = self._children.pop(msg["exit"], None)
                    if child is not None:
                        child._exited(msg["code"])
        # the zygote is gone (closed, or died): it killed its workers on the way out, unless it was killed
        self.closed = True
        for child in list(self._children.values()):
            child.kill()
            child._exited(-signal.SIGKILL)
        self._children.clear()
        while self._pending:
            self._pending.pop(0)
            self._replies.put(RuntimeError("the worker launcher (zygote) exited before it started the worker"))


# What the imports in a zygote may have read: the variables of Python, the loader, torch, its OpenMP, MKL and
# oneDNN, transformers and shoal. A change in any of them needs a zygote of its own; every other variable is
# set in the forked child as the starter has it.
IMPORT_TIME_VARIABLES = ("PYTHON", "LD_", "SHOAL_", "TORCH", "PYTORCH_", "ATEN_", "OMP_", "KMP_", "GOMP_", "MKL_",
                         "ONEDNN_", "DNNL_", "HF_", "TRANSFORMERS_", "CUDA_", "TOKENIZERS_")


def _key(env, cwd: str) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_VARIABLES))), cwd


_zygotes: list[Zygote] = []
PRELOAD = True  # the tests of the zygote itself turn it off: their probes import nothing of a rank's
_zygotes_lock = threading.Lock()


def spawn(module: str, argv: list[str], retry: bool = True) -> ForkedProcess:
    """MODULE.main(ARGV) in a process forked from this process's zygote for its current environment
    and working directory (started now if there is none). Zygotes of an earlier environment are closed once
    none of their workers is left."""
    key = _key(os.environ, os.getcwd())
    with _zygotes_lock:
        for z in [z for z in _zygotes if z.closed or (z.key != key and z.live_children() == 0)]:
            _zygotes.remove(z)
            z.close()
        zygote = next((z for z in _zygotes if z.key == key), None)
        if zygote is None:
            zygote = Zygote(dict(os.environ), os.getcwd(), preload=PRELOAD)
            _zygotes.append(zygote)
    try:
        return zygote.spawn(module, argv)
    except RuntimeError:
        if not retry:
            raise
        return spawn(module, argv, retry=False)  # it had just exited, idle: once more, from a new one


# ---------------------------------------------------------------- the zygote process


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_module(msg: dict, keep: tuple[int, ...]) -> None:
    """In the forked child: run MODULE.main(ARGV) with the starter's environment, and exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep:
            os.close(fd)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        code = importlib.import_module(msg["module"]).main(msg["argv"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (a rank's failure: its traceback, and a non-zero exit)
        traceback.print_exc()
    finally:
        logging.shutdown()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def preload() -> None:
    """What every rank imports, once (the reason this process exists): the worker, the runner's builder, the
    GGUF reader, the text families' modules and their transformers configurations (AutoConfig imports a
    family's configuration, and with it much of transformers, on first use). Imports only: nothing computes, so
    no thread pool exists when a rank is forked. (A vision model runs on one rank, never on a worker.)"""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import shoal.executor.worker  # noqa: F401
    import shoal.model.gguf_loader  # noqa: F401
    import shoal.runner.build  # noqa: F401
    from shoal.model.registry import model_class

    for arch, model_type in TEXT_FAMILIES.items():
        model_class([arch])
        CONFIG_MAPPING[model_type]


IDLE_S = 60.0  # a zygote with no process of its left for this long exits (it holds ~230 MB of imports)
TEXT_FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}


def main(argv: list[str]) -> None:
    req, rep, idle_s = int(argv[0]), int(argv[1]), float(argv[2])
    if argv[3] == "preload":
        preload()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    buf = b""

    def reply(msg: dict) -> None:
        try:
            os.write(rep, (json.dumps(msg) + "\n").encode())
        except BrokenPipeError:  # the starter is gone: the end of its input follows, and the ranks are killed then
            pass

    def reap() -> None:
        nonlocal idle_since
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            reply({"exit": pid, "code": _code(status)})
            if not children:
                idle_since = time.monotonic()

    idle_since = time.monotonic()
    while True:
        timeout = None if children else max(0.0, idle_since + idle_s - time.monotonic())
        ready, _, _ = select.select([req, wake_r], [], [], timeout)
        if not ready and not children:  # idle for idle_s: give the memory back (the next spawn starts a zygote)
            return
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            reap()
        if req not in ready:
            continue
        data = os.read(req, 65536)
        if not data:  # the starter closed its end, or is gone: its workers serve no one
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in list(children):
                try:
                    _, status = os.waitpid(pid, 0)
                except ChildProcessError:
                    continue
                reply({"exit": pid, "code": _code(status)})
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_module(msg, (req, rep, wake_r, wake_w))
            children.add(pid)
            reply({"pid": pid})


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(0)  # nothing to tear down: the interpreter's teardown of torch would take about a second
