"""A real shoal server for tests: uvicorn on a free 127.0.0.1 port, in a background thread.

In-process, so a test can also look at the engine (pool, stats) it serves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import uvicorn

from shoal.config import CacheConfig, EngineConfig, SchedulerConfig
from shoal.server import ServerSettings, create_app
from shoal.server.listen import listening_socket


def tiny_engine_config(model_path, **kw) -> EngineConfig:
    top = {k: kw.pop(k) for k in list(kw) if k in EngineConfig.__dataclass_fields__}
    sched = {k: kw.pop(k) for k in list(kw) if k in SchedulerConfig.__dataclass_fields__}
    cache = {k: kw.pop(k) for k in list(kw) if k in CacheConfig.__dataclass_fields__}
    cache.setdefault("num_blocks", 512)
    cache.setdefault("block_size", 8)
    # float32 as the references are: "auto" would pick bfloat16 on CPUs with native bf16
    top.setdefault("dtype", "float32")
    if kw:
        raise TypeError(f"unknown engine arguments: {sorted(kw)}")
    return EngineConfig(model=str(model_path), scheduler=SchedulerConfig(**sched), cache=CacheConfig(**cache), **top)


def tiny_engine(model_path, **kw):
    from shoal.engine.builder import build_engine

    return build_engine(tiny_engine_config(model_path, **kw))


class LiveServer:
    """`with LiveServer(engine_or_config, settings) as srv:` -> srv.url, srv.engine, srv.openai()."""

    def __init__(self, engine_or_config, settings: ServerSettings | None = None, wait_ready: bool = True, **app_kw) -> None:
        """`app_kw`: create_app's lifecycle and clock (several models)."""
        self.app = create_app(engine_or_config, settings or ServerSettings(log_requests=False), **app_kw)
        self.wait_ready = wait_ready
        self._sock = listening_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", log_config=None, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.shoal

    @property
    def engine(self):
        """The default model's Engine, behind its AsyncEngine (the server's door): tests may look inside."""
        door = self.state.engine
        return door.engine if door is not None else None

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        if self.wait_ready:
            self.wait_until(lambda: self.state.models.preloaded, what="the models to load")
            assert self.state.status == "ok", self.state.load_error
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)

    def openai(self, **kw):
        import openai

        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), trust_env=False, **kw)

    @staticmethod
    def wait_until(cond, timeout: float = 30.0, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)


class Gate:
    """Hold the engine inside a step: once `after_steps` steps ran (or `when()` is true
    at the start of a step), each step blocks until `open()`. The engine thread
    stays in the runner, so nothing it owns changes while a test looks."""

    def __init__(self, engine, after_steps: int | None = None, when: Callable[[], bool] | None = None) -> None:
        self.runner = engine.runner
        self.real = self.runner.execute
        self.after_steps = after_steps
        self.when = when
        self.steps = 0
        self.blocked = threading.Event()
        self._open = threading.Event()

    def __enter__(self) -> Gate:
        def execute(plan):
            self.steps += 1
            hold = (self.after_steps is not None and self.steps > self.after_steps) or (self.when is not None and self.when())
            if hold and not self._open.is_set():
                self.blocked.set()
                assert self._open.wait(30), "the test never opened the gate"
            return self.real(plan)

        self.runner.execute = execute
        return self

    def open(self) -> None:
        self._open.set()

    def __exit__(self, *exc) -> None:
        self._open.set()
        self.runner.execute = self.real
