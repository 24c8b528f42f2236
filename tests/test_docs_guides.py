"""The guides on security, configuration and running as a service (docs/guides/) stay true to the code.

- configuration.md's example shoal.yaml goes through the path `shoal serve --config` takes (the parser,
  `serve_values`, `load_config_file`, then the engine's and the server's settings), holds every key
  `shoal serve` accepts, and each commented-out key shows its real default unless it says it is an example;
- the unit file's ExecStart parses with shoal's own parser as `shoal serve --config ...`, and the page shows
  that very file;
- (every `--flag` the pages write exists on the subcommand that takes it: tests/test_docs.py checks every page);
- every environment variable the pages name is read somewhere in shoal's source, and every SHOAL_ variable
  shoal reads is in configuration.md's table;
- the claims the pages make about the config file, the kernels' cache and shutdown match the code.

Nothing here starts a server or loads a model.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from shoal import cli
from test_docs import ref

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
PAGES = ("security.md", "configuration.md", "service.md")
UNIT = GUIDES / "shoal.service"

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def page(name: str) -> str:
    return (GUIDES / name).read_text()


def flat(name: str) -> str:
    """A page with its line breaks and indents as single spaces, for phrases that may wrap."""
    return re.sub(r"\s+", " ", page(name))


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    return FENCE.sub("", text)




# ---------------------------------------------------------------- (a) the example shoal.yaml


def example_yaml() -> str:
    blocks = [body for lang, body in code_blocks(page("configuration.md")) if lang == "yaml"]
    assert len(blocks) == 1, "configuration.md should hold exactly one yaml block: the example shoal.yaml"
    return blocks[0]


COMMENTED_KEY = re.compile(r"^#\s?([A-Za-z][\w-]*):(\s.*)?$")


def commented_keys(text: str) -> list[tuple[str, str]]:
    """(key, the line uncommented) for each commented-out `# key: value` line."""
    out = []
    for line in text.splitlines():
        m = COMMENTED_KEY.match(line.strip())
        if m:
            out.append((m.group(1), line.strip()[1:].strip()))
    return out


@pytest.fixture
def no_env_key(monkeypatch):
    monkeypatch.delenv("SHOAL_API_KEY", raising=False)


def serve_config(path: Path, *flags: str) -> dict:
    """What `shoal serve --config PATH FLAGS` would run with, as cmd_serve computes it before loading anything."""
    a = cli.build_parser().parse_args(["serve", "--config", str(path), *flags])
    assert a.func is cli.cmd_serve
    return cli.serve_values(a)


def test_the_example_config_is_accepted_by_shoal_serve(tmp_path, no_env_key):
    text = example_yaml()
    path = tmp_path / "shoal.yaml"
    path.write_text(text)
    loaded = cli.load_config_file(path)  # raises on an unknown key
    assert len(loaded) >= 5, "the example should set a few keys, not only comment them"
    v = serve_config(path)
    for key, value in loaded.items():  # the file was read, and its values are the ones served
        assert v[key] == value, key
    config = cli.engine_config(v)  # validates the engine's settings
    settings = cli.server_settings(v)  # validates the server's
    assert config.model == str(loaded.get("model", "smollm2"))
    assert settings.host == loaded.get("host", "127.0.0.1")
    # The page says the file is for a server behind a proxy on this machine: keep it on loopback, without a key.
    assert settings.host in ("127.0.0.1", "localhost", "::1")
    assert settings.api_key is None


def test_the_example_config_names_every_key_once():
    text = example_yaml()
    active = list(yaml.safe_load(text))
    commented = [k for k, _ in commented_keys(text)]
    known = {o.key for o in cli.SERVE_OPTS} | set(cli.CONFIG_ONLY_KEYS)
    named = [k.replace("-", "_") for k in active + commented]
    assert not set(named) - known, f"not shoal serve keys: {sorted(set(named) - known)}"
    assert not known - set(named), f"keys missing from the example: {sorted(known - set(named))}"
    dupes = {k for k in named if named.count(k) > 1}
    assert not dupes, f"keys written twice: {sorted(dupes)}"


def test_commented_keys_are_valid_and_show_their_defaults(tmp_path):
    defaults = {o.key: o.default for o in cli.SERVE_OPTS}
    lines = commented_keys(example_yaml())
    assert len(lines) > 20
    for key, line in lines:
        path = tmp_path / "one.yaml"
        path.write_text(line + "\n")
        ((name, value),) = cli.load_config_file(path).items()  # a real key, and valid YAML once uncommented
        if "example" in line.partition("#")[2]:
            continue
        assert value == defaults[name], f"`{line}` says {value!r}, but --{key} defaults to {defaults[name]!r}"


def test_the_files_keys_take_dashes_or_underscores_and_flags_win(tmp_path, monkeypatch):
    path = tmp_path / "shoal.yaml"
    path.write_text("max-model-len: 1024\nmax_num_seqs: 8\nport: 8100\napi-key: from-file\nprefix-cache: false\n"
                    "allowed-origins: https://a.example\nlog-level: warning\n")
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    v = serve_config(path, "--port", "9000")
    assert (v["max_model_len"], v["max_num_seqs"], v["port"], v["prefix_cache"]) == (1024, 8, 9000, False)
    assert v["allowed_origins"] == ["https://a.example"] and v["log_level"] == "warning"
    assert v["api_key"] == "from-file"  # the file wins over $SHOAL_API_KEY
    assert serve_config(path, "--api-key", "from-flag")["api_key"] == "from-flag"  # and a flag over both
    path.write_text("")
    assert serve_config(path)["api_key"] == "from-env"  # an empty file sets nothing
    assert cli.server_settings(serve_config(path, "--api-key", "")).api_key is None  # an empty key: no key


@pytest.mark.parametrize("body, words", [
    ("seed: 1\n", ["unknown key 'seed'", "max-model-len"]),  # the message lists the known keys
    ("no-prefix-cache: true\n", ["unknown key 'no-prefix-cache'"]),
    ("- a\n- b\n", ["must be a mapping"]),
    ("port: [\n", ["not valid YAML"]),
])
def test_a_bad_config_file_is_refused_before_anything_loads(tmp_path, body, words):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ValueError) as e:
        cli.load_config_file(path)
    for w in words:
        assert w in str(e.value)


def test_a_bad_config_key_ends_shoal_serve_with_status_2(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 1\n")
    for name in ("SHOAL_LOG_LEVEL", "SHOAL_LOG_FORMAT"):  # main() sets them; put them back afterwards
        monkeypatch.setenv(name, "info" if name.endswith("LEVEL") else "text")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:  # main() configures logging; the rest of the session keeps pytest's
        assert cli.main(["serve", "--config", str(path)]) == 2
        assert "unknown key 'seed'" in capsys.readouterr().err
        assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
        assert "does not exist" in capsys.readouterr().err
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_only_serve_takes_a_config_file():
    takers = sorted(name for name, p in ref.subcommands().items() if "--config" in ref.cli_flags(p))
    assert takers == ["serve"]
    assert "Only `shoal serve` takes `--config`" in flat("configuration.md")


def test_deterministic_in_the_file_sets_mkl_cbwr_as_the_flag_does(tmp_path, monkeypatch):
    """configuration.md says the file's `deterministic: true` does what the flag does: cmd_serve sets MKL_CBWR
    from the values it resolves, the file's included."""
    on, off = tmp_path / "on.yaml", tmp_path / "off.yaml"
    on.write_text("deterministic: true\n")
    off.write_text("deterministic: false\n")
    parse = cli.build_parser().parse_args
    for flags, expect in ((["--config", str(on)], "AUTO,STRICT"), (["--deterministic"], "AUTO,STRICT"),
                          (["--config", str(off)], None), ([], None)):
        monkeypatch.delenv("MKL_CBWR", raising=False)
        cli.strict_mkl_if(bool(cli.serve_values(parse(["serve", *flags])).get("deterministic")))
        assert os.environ.get("MKL_CBWR") == expect, flags
    assert "strict_mkl_if(bool(v.get(\"deterministic\")))" in inspect.getsource(cli.cmd_serve)
    assert "`deterministic: true` in the file does what `--deterministic` does" in flat("configuration.md")


# ---------------------------------------------------------------- (b) the systemd unit


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_units_execstart_parses_as_shoal_serve_with_the_config():
    (cmd,) = unit_settings()["ExecStart"]
    argv = shlex.split(cmd)
    assert argv[0].startswith("/") and Path(argv[0]).name == "shoal" and argv[0].endswith(".venv/bin/shoal")
    a = cli.build_parser().parse_args(argv[1:])
    assert a.command == "serve" and a.func is cli.cmd_serve
    assert a.config == "/etc/shoal/shoal.yaml"
    assert example_yaml().splitlines()[0].startswith(f"# {a.config}")  # the example is that file


def test_the_service_page_shows_the_shipped_unit_file():
    unit = UNIT.read_text()
    assert ("ini", unit) in code_blocks(page("service.md"))
    assert "[shoal.service](shoal.service)" in page("service.md")


def test_the_unit_has_what_the_page_describes():
    u = unit_settings()
    assert u["Restart"] == ["on-failure"] and u["KillMode"] == ["mixed"] and u["NoNewPrivileges"] == ["yes"]
    assert u["ProtectSystem"] == ["strict"] and u["PrivateTmp"] == ["yes"]
    assert u["User"] == ["shoal"] and u["EnvironmentFile"] == ["/etc/shoal/shoal.env"]
    assert "PrivateDevices" not in u and "MemoryDenyWriteExecute" not in u  # service.md says why not
    # The kernels' cache is the unit's own writable cache directory.
    (cache,) = u["CacheDirectory"]
    assert f"XDG_CACHE_HOME=/var/cache/{cache}" in u["Environment"]


def test_the_kernels_cache_is_where_service_md_says(monkeypatch):
    """A venv the service user cannot write: shoal builds its kernels under $XDG_CACHE_HOME/shoal/kernels."""
    kernels = pytest.importorskip("shoal.kernels")
    monkeypatch.setattr(kernels.os, "access", lambda path, mode: False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/shoal")
    assert kernels.library_path().parent == Path("/var/cache/shoal/shoal/kernels")
    assert "`/var/cache/shoal/shoal/kernels`" in flat("service.md")
    monkeypatch.setattr(kernels.os, "access", lambda path, mode: True)  # writable: beside the venv instead
    assert kernels.library_path().parent.parent == Path(kernels.sys.prefix)


def test_tensor_parallel_shared_memory_lives_in_dev_shm():
    from shoal.executor.shm import SharedMemoryChannel

    assert SharedMemoryChannel.new_path().startswith("/dev/shm/")
    assert "`/dev/shm`" in page("service.md")


def test_the_graceful_shutdown_time_is_the_one_the_page_gives():
    m = re.search(r"timeout_graceful_shutdown=(\d+)", inspect.getsource(cli.cmd_serve))
    assert m, "cmd_serve no longer sets uvicorn's timeout_graceful_shutdown: update service.md's Stopping"
    seconds = int(m.group(1))
    assert f"up to {seconds} seconds to finish" in flat("service.md")
    (stop,) = unit_settings()["TimeoutStopSec"]
    assert int(stop) > seconds + 10  # the engine and the worker processes get time to stop too


# ---------------------------------------------------------------- (c) every --flag exists: tests/test_docs.py, for every page


# ---------------------------------------------------------------- (d) environment variables


def variables_read_by_shoal() -> set[str]:
    """Names shoal's source reads: os.environ.get/[...]/setdefault/in, os.getenv; getenv in the native kernels."""
    names = set()
    for path in (ROOT / "shoal").rglob("*.[ch]*"):
        if path.suffix in (".cpp", ".h"):
            names |= set(re.findall(r'\bgetenv\("([A-Z][A-Z0-9_]*)"\)', path.read_text()))

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for path in (ROOT / "shoal").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                if isinstance(f, ast.Attribute) and (
                    (f.attr in ("get", "setdefault") and is_environ(f.value)) or f.attr == "getenv"
                ):
                    key = node.args[0].value
            elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
                if isinstance(node.slice, ast.Constant):
                    key = node.slice.value
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
                if any(isinstance(op, ast.In) for op in node.ops) and any(is_environ(c) for c in node.comparators):
                    key = node.left.value
            if isinstance(key, str):
                names.add(key)
    return names


ENV_PATTERNS = (
    re.compile(r"\$\{?([A-Z][A-Z0-9_]*)"),  # $NAME, ${NAME}
    re.compile(r"(?<![\w-])([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)(?![\w-])"),  # NAME_WITH_UNDERSCORES
)


def variables_named(text: str) -> set[str]:
    names = {n for p in ENV_PATTERNS for n in p.findall(text)}
    for _, body in code_blocks(text):  # NAME=value in shell lines and unit files
        names |= set(re.findall(r"^\s*(?:export\s+|Environment=)?([A-Z][A-Z0-9_]*)=", body, re.M))
    for line in prose(text).splitlines():  # the first cell of a table row: `CXX`, `RANK`
        if line.startswith("|"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("name", PAGES)
def test_every_environment_variable_named_is_read_by_shoal(name):
    read = variables_read_by_shoal()
    named = variables_named(page(name))
    assert named, f"{name} names no environment variable"
    assert not named - read, f"{name} names variables shoal never reads: {sorted(named - read)}"


def test_every_shoal_variable_is_in_the_table():
    read = {n for n in variables_read_by_shoal() if n.startswith("SHOAL_")}
    assert {"SHOAL_API_KEY", "SHOAL_URL", "SHOAL_CPU_ISA", "SHOAL_NO_KERNELS"} <= read  # the scan works
    table = "\n".join(line for line in prose(page("configuration.md")).splitlines() if line.startswith("|"))
    missing = {n for n in read if f"`{n}`" not in table}
    assert not missing, f"configuration.md's table lacks {sorted(missing)}"


def test_the_variable_check_sees_what_it_should():
    named = set().union(*(variables_named(page(n)) for n in PAGES))
    assert {"SHOAL_API_KEY", "XDG_CACHE_HOME", "CXX", "RANK", "MKL_CBWR"} <= named
    assert "SHOAL_NO_SUCH_THING" in variables_named("set `SHOAL_NO_SUCH_THING=1`")
    assert "SHOAL_NO_SUCH_THING" not in variables_read_by_shoal()
