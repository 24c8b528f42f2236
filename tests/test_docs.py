"""The docs are part of the product: they build, their links hold, their quickstart runs, and the
generated references list exactly what the code has.

- `mkdocs build --strict` over the whole site (a broken link, anchor or missing page fails);
- the README's quickstart, run as written against a live `shoal serve` of the default model;
- the command line, HTTP and metrics references against the parser, the app's route table and a
  live server's `/metrics`, in both directions; flags named anywhere in the docs must exist;
- the README stays short and says nothing the docs also write out.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server_utils import LiveServer, tiny_engine
from shoal.config import SpeculativeConfig
from shoal.server import metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

_spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "tools" / "docs_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


def mkdocs_build(site_dir: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = mkdocs_build(out)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def page_text(site: Path, name: str) -> str:
    return html.unescape((site / name).read_text())


# ---------------------------------------------------------------- the site builds, strictly


def test_the_site_builds_strictly_and_every_page_is_in_it(site):
    for page in ("index.html", "getting-started.html", "guides/anthropic.html", "reference/cli.html", "reference/http.html",
                 "reference/python.html", "reference/metrics.html", "architecture/index.html", "benchmarks/index.html",
                 "benchmarks/NOTES.html", "benchmarks/results/compare_peers-avx2.html", "guides/grafana-dashboard.json"):
        assert (site / page).is_file(), page
    # The README's sections are included, not copied: the home page shows its feature table.
    assert "same answer whatever the batch" in page_text(site, "index.html")
    # mkdocstrings rendered the Python API from the docstrings.
    python = page_text(site, "reference/python.html")
    for name in ("LLM", "SamplingParams", "RequestOutput", "generate", "chat"):
        assert re.search(rf"\b{name}\b", python), name


def test_every_markdown_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(entries):
        for e in entries:
            value = next(iter(e.values())) if isinstance(e, dict) else e
            yield from pages(value) if isinstance(value, list) else [value]

    nav = set(pages(config["nav"]))
    files = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert files == nav


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# home\n\nSee [the missing page](missing.md).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    strict = {k: config[k] for k in ("strict", "validation")}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump({"site_name": "t", "docs_dir": str(docs), **strict}))
    built = mkdocs_build(tmp_path / "site", tmp_path / "mkdocs.yml")
    assert built.returncode != 0
    assert "missing.md" in built.stderr


# ---------------------------------------------------------------- the README


def test_the_readme_stays_short():
    assert README.stat().st_size <= 12 * 1024


def test_the_readme_writes_nothing_the_docs_also_write():
    """Its sections reach the docs by inclusion (`--8<--`), so no sentence of it is in a page's source."""
    sources = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)  # code may be shown twice; prose may not
    lines = [line.strip() for line in prose.splitlines() if len(line.strip()) >= 60]
    assert lines
    assert [line for line in lines if line in sources] == []


def quickstart_blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text.split("[start:quickstart]", 1)[1].split("[end:quickstart]", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def test_the_quickstart_runs_against_a_live_server(tmp_path):
    """Every snippet of the README's quickstart, as written, against `shoal serve` of the default model."""
    blocks = quickstart_blocks()
    assert blocks[0] == ("sh", "make serve\n")  # the server: started here as `make serve` starts it, on a free port
    langs = [lang for lang, _ in blocks[1:]]
    assert langs == ["sh", "sh", "python", "python"]  # shoal chat, curl, the openai SDK, the anthropic SDK
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    venv_bin = Path(sys.executable).parent
    server = subprocess.Popen([str(venv_bin / "shoal"), "serve", "--port", str(port)], stdout=open(tmp_path / "serve.log", "w"),
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for lang, code in blocks[1:]:
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(".venv/bin/", f"{venv_bin}/")
            cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
            # `shoal chat` finds the server at $SHOAL_URL (its default is port 8000, which this test cannot take)
            run = subprocess.run(cmd, input="What is the capital of France?\n", capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "SHOAL_URL": f"http://127.0.0.1:{port}"})
            assert run.returncode == 0, (code, run.stderr[-2000:])
            # Every snippet asks the same question greedily; the default model knows the answer.
            assert "Paris" in run.stdout, (code, run.stdout[-2000:])
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------- the generated references


def section_codes(page: str, start: str, end: str | None) -> set[str]:
    body = page.split(f'id="{start}"', 1)[1]
    if end is not None:
        body = body.split(f'id="{end}"', 1)[0]
    return set(re.findall(r"<code>(--[a-z][a-z0-9-]*)</code>", body))


def test_the_cli_reference_lists_every_flag_of_every_command_and_no_other(site):
    page = page_text(site, "reference/cli.html")
    subs = ref.subcommands()
    names = list(subs)
    assert set(re.findall(r'<h2 id="shoal-([a-z]+)"', page)) == set(names)
    for i, name in enumerate(names):
        listed = section_codes(page, f"shoal-{name}", f"shoal-{names[i + 1]}" if i + 1 < len(names) else None)
        assert listed == ref.cli_flags(subs[name]), name
    assert "--log-level" in page.split('id="shoal-serve"')[0]  # the top-level flag


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHOAL_COMMAND = re.compile(r"(?:^|[\s=/`])shoal(?:\.cli)?\s+([a-z]+)")
# Flags written alone in the docs' prose that belong to other programs.
FOREIGN_FLAGS = {"--continuous-batching", "--enable-deterministic-inference"}  # transformers serve, SGLang
ANY_COMMAND = {"--help", "--no-"}  # argparse's own; the `--no-` prefix of a switch, written alone


def flags_named(text: str):
    """(subcommand, flag) for each flag a page gives shoal: on its command lines (continuations too) and in
    its prose's code spans. The subcommand is None where the page names none (a flag written alone)."""
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        command = None
        for line in block.splitlines():
            m = SHOAL_COMMAND.search(line)
            command = m.group(1) if m else command
            if m or command:
                yield from ((command, f) for f in FLAG.findall(line.split(" #")[0][m.end() if m else 0:]))
            command = command if line.rstrip().endswith("\\") else None
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        m = SHOAL_COMMAND.search(" " + span)
        if span.startswith("--") or m:
            yield from ((m.group(1) if m else None, f) for f in FLAG.findall(span))


def test_the_docs_name_only_flags_that_exist():
    """A flag on a `shoal SUB` line must be SUB's own; one written alone, any command's (or a benchmark's)."""
    subs = {name: ref.cli_flags(p) | {"--log-level"} for name, p in ref.subcommands().items()}
    anywhere = set().union(*subs.values())
    bench_flags = set(re.findall(r'"(--[a-z][a-z0-9-]*)"', "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))))
    named, unknown = set(), {}
    for path in [README, *DOCS.rglob("*.md")]:
        for command, flag in flags_named(path.read_text()):
            named.add((command, flag))
            takes = subs[command] if command in subs else anywhere | bench_flags | FOREIGN_FLAGS
            if flag not in takes | ANY_COMMAND:
                unknown.setdefault(f"shoal {command} {flag}" if command in subs else flag, []).append(str(path.relative_to(ROOT)))
    assert unknown == {}
    # the scan finds what the guides use, with the command each line names
    assert {("serve", "--tensor-parallel-size"), ("serve", "--api-key"), ("serve", "--config"), ("worker", "--nnodes"),
            ("chat", "--temperature")} <= named
    assert list(flags_named("```sh\nshoal chat --port 1 \\\n  --max-num-seqs 2\n```")) == [("chat", "--port"), ("chat", "--max-num-seqs")]


def test_the_http_reference_lists_every_route_and_no_other(site):
    page = page_text(site, "reference/http.html")
    listed = set(re.findall(r"<td>(GET|POST|PUT|PATCH|DELETE)</td>\s*<td>(?:<a [^>]*>)?<code>([^<]+)</code>", page))
    routes = set(ref.app_routes())
    assert listed == routes
    # Every route in the OpenAPI document has its own section with its statuses.
    for method, path in ref.routes():
        assert f'id="{ref._anchor(method, path)}"' in page, (method, path)


def test_the_metrics_reference_lists_exactly_what_a_live_server_serves(site, tiny_llama_path, tmp_path):
    page = page_text(site, "reference/metrics.html")
    listed = set(re.findall(r"<tr>\s*<td><code>([a-z0-9_:]+)</code></td>", page))
    catalog = metrics.catalog()
    shown = {f"{f.name}_total" if f.type == "counter" else f.name for f in catalog}
    assert listed == shown
    # A live server with traffic (the prefix cache's second tier and speculative decoding on) serves every family
    # of the catalog and no other.
    engine = tiny_engine(tiny_llama_path, prefix_cache_dir=str(tmp_path / "tier"), speculative=SpeculativeConfig(method="ngram"))
    with LiveServer(engine) as srv:
        client = srv.openai()
        for _ in range(2):  # the second is a prefix-cache hit
            client.completions.create(model=str(tiny_llama_path), prompt="one two three four five six seven eight nine ten", max_tokens=4)
        text = httpx.get(srv.url + "/metrics").text
    served = {}
    for family in text_string_to_metric_families(text):
        served[family.name] = family.type
    assert served == {f.name: f.type for f in catalog}
