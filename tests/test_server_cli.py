"""The `shoal` command line: chat through its input stream, complete, models, serve with a config file."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import LiveServer, tiny_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shoal(*args, stdin=None, timeout=60):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONPATH": ROOT}
    env.pop("SHOAL_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args], input=stdin, capture_output=True, text=True,
        encoding="utf-8", errors="replace", timeout=timeout, env=env, cwd=ROOT,
    )


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    engine = tiny_engine(tiny_llama_path)
    seen = []
    real_add = engine.add_request

    def add_request(request, checked=False):  # record what reaches the engine
        seen.append(request)
        return real_add(request, checked=checked)

    engine.add_request = add_request
    with LiveServer(engine) as s:
        s.seen = seen
        yield s


def test_chat_two_turns_the_second_sees_the_first(srv):
    srv.seen.clear()
    out = shoal("chat", "--url", srv.url, "--temperature", "0", "--max-tokens", "6", "--show-usage",
                stdin="My name is Zed.\nWhat is my name?\n")
    assert out.returncode == 0, out.stderr
    assert len(srv.seen) == 2
    replies = [part.split("\n[usage:")[0] for part in out.stdout.split("model> ")[1:]]
    assert len(replies) == 2
    tok = srv.engine.tokenizer
    second = tok.decode(srv.seen[1].prompt_token_ids)
    first_turn = f"<|im_start|>user\nMy name is Zed.<|im_end|>\n<|im_start|>assistant\n{replies[0]}<|im_end|>\n"
    assert second.startswith(first_turn), second
    assert second.endswith("<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n")
    assert out.stdout.count("[usage: prompt ") == 2


def test_chat_system_and_reset(srv):
    srv.seen.clear()
    out = shoal("chat", "--url", srv.url, "--max-tokens", "2", stdin="/system Be brief.\nhello\n/reset\nagain\n/quit\nnever sent\n")
    assert out.returncode == 0, out.stderr
    assert "conversation cleared" in out.stdout
    prompts = [srv.engine.tokenizer.decode(r.prompt_token_ids) for r in srv.seen]
    assert len(prompts) == 2
    assert prompts[0].startswith("<|im_start|>system\nBe brief.<|im_end|>") and "hello" in prompts[0]
    assert prompts[1].startswith("<|im_start|>system\nBe brief.<|im_end|>") and "hello" not in prompts[1] and "again" in prompts[1]


def test_complete_streams_the_same_text_as_the_api(srv):
    out = shoal("complete", "Once upon a time", "--url", srv.url, "--temperature", "0", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    ref = srv.openai().completions.create(model=srv.state.model_name, prompt="Once upon a time", temperature=0, max_tokens=8)
    assert out.stdout == ref.choices[0].text + "\n"


def test_models_lists_the_served_model(srv):
    out = shoal("models", "--url", srv.url)
    assert out.returncode == 0 and out.stdout.startswith(srv.state.model_name)


def test_unreachable_server_is_one_readable_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        for args in (["models"], ["complete", "x"], ["chat"]):
            out = shoal(*args, "--url", f"http://127.0.0.1:{port}", stdin="")
            assert out.returncode == 1
            assert out.stderr.strip() == f"shoal: server not reachable at http://127.0.0.1:{port} (is `shoal serve` running?)"


def test_server_errors_are_one_readable_line(srv):
    out = shoal("complete", "x", "--url", srv.url, "--temperature", "-1")
    assert out.returncode == 1
    assert out.stderr.strip().startswith("shoal: the server answered 400: ") and "temperature" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["serve", "chat", "complete", "models", "generate", "repl"])
def test_help(command):
    out = shoal(command, "--help")
    assert out.returncode == 0 and "usage: shoal " + command in out.stdout


def test_serve_with_a_config_file_and_flags(tiny_llama_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "shoal.yaml"
    cfg.write_text(f"model: {tiny_llama_path}\nport: 1\nserved-model-name: from-yaml\nmax-tokens: 3\nignore-eos: true\n"
                   "kv-cache-memory: 16MiB\nlog-level: warning\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--config", str(cfg), "--port", str(port),
                             "--served-model-name", "from-flag"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "shoal serve did not become healthy"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"] == "from-flag"
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, trust_env=False)
        assert r.json()["usage"]["completion_tokens"] == 3  # max-tokens and ignore-eos from the file
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode in (0, -15)


def test_serve_with_a_wrong_model_fails_in_one_line(tmp_path):
    out = shoal("serve", "--model", str(tmp_path / "nothing.gguf"), "--port", "0")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("shoal: model path") and len(out.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_forced_code_path_the_cpu_lacks_in_one_line(tmp_path):
    """SHOAL_CPU_ISA names a kernel path (shoal/kernels); one the CPU lacks, or no path at all, stops `serve` before
    it listens. On an AVX-512 CPU no real path is lacking, so a name that is none stands in for it there; the rule
    for each level is tests/test_kernels.py's."""
    from shoal import kernels

    best = int(__import__("torch").ops.shoal_kernels.use_isa(0)) if kernels.available() else None
    lacking = next((name for name, level in kernels.ISA_LEVELS.items() if best is not None and level > best), "avx1024")
    env = {**os.environ, "PYTHONPATH": ROOT, "SHOAL_CPU_ISA": lacking}
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "serve", "--port", "0"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().startswith(f"shoal: SHOAL_CPU_ISA={lacking}") and len(out.stderr.strip().splitlines()) == 1
    assert "uvicorn" not in out.stderr and "serving" not in out.stderr


def test_chat_reports_a_refused_turn_and_goes_on(srv):
    out = shoal("chat", "--url", srv.url, "--temperature", "-1", stdin="first\nsecond\n")
    assert out.returncode == 0
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("shoal: the server answered 400:") and "temperature" in e for e in errors)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_served_connections_send_without_nagle_delay(host):
    """uvicorn serves on the CLI's own socket; asyncio turns Nagle off on an accepted connection
    only when that socket says it is TCP. Otherwise a kept-open connection's responses (headers,
    then body) and a stream's chunks wait on the client's delayed ACK."""
    import asyncio

    from shoal.server.listen import listening_socket

    try:
        sock = listening_socket(host, 0)
    except OSError:
        pytest.skip(f"no {host} on this machine")

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(host, sock.getsockname()[1])
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
