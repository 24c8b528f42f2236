"""The docs are part of the product: they build, their links hold, their quickstart runs, and the
generated references list exactly what the code has.

- `mkdocs build --strict` over the whole site (a broken link, anchor or missing page fails);
- the README's quickstart, run as written against a live `shoal serve` of the default model;
- the command line, HTTP and metrics references against the parser, the app's route table and a
  live server's `/metrics`, in both directions; flags named anywhere in the docs must exist;
- the README stays short and says nothing the docs also write out; each gap its feature table admits names an
  open issue, and the families, vision families and K-quants it names are the ones the code registers;
- every piece of shoal's code the architecture pages name in backticks exists (paths, modules, classes and
  their attributes, functions with the keywords shown, constants, tests, environment variables, metrics).
"""

from __future__ import annotations

import ast
import builtins
import functools
import html
import importlib
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


# The tracker's open issues (kept by hand: CI cannot reach the tracker; a resolved issue leaves this list): a gap
# in shoal's column of the feature table names one as #N.
OPEN_ISSUES = {51: "GGUF K-quants speed, the CUDA path measured", 53: "decode's fixed cost"}
GAP = re.compile(r"\b(not yet|no|none|planned|untested|unmeasured|partial|coming)\b", re.I)
# How the README names each architecture shoal registers. Idefics3 is SmolVLM's own architecture (its
# checkpoints declare it); SmolLM2 is a Llama.
README_FAMILIES = {"LlamaForCausalLM": ("Llama", "SmolLM2"), "MistralForCausalLM": ("Mistral",), "Qwen2ForCausalLM": ("Qwen2",),
                   "Qwen3ForCausalLM": ("Qwen3",), "Qwen2VLForConditionalGeneration": ("Qwen2-VL",),
                   "Qwen2_5_VLForConditionalGeneration": ("Qwen2.5-VL",), "Idefics3ForConditionalGeneration": ("SmolVLM",),
                   "SmolVLMForConditionalGeneration": ("SmolVLM",), "Phi3ForCausalLM": ("Phi-3", "Phi-4"),
                   "Gemma2ForCausalLM": ("Gemma 2",), "Gemma3ForCausalLM": ("Gemma 3",), "Qwen3MoeForCausalLM": ("Qwen3-MoE",),
                   "MixtralForCausalLM": ("Mixtral",), "OlmoeForCausalLM": ("OLMoE",)}


def feature_rows() -> dict[str, str]:
    """The README's feature table: each row's first cell -> shoal's cell."""
    section = README.read_text().split("[start:features]", 1)[1].split("[end:features]", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    assert rows[0][1] == "shoal"
    return {r[0]: r[1] for r in rows[2:]}


def readme_intro() -> str:
    return re.sub(r"\s+", " ", README.read_text().split("[start:intro]", 1)[1].split("[end:intro]", 1)[0])


def test_every_gap_in_the_feature_table_names_an_open_issue():
    rows = feature_rows()
    wrong = []
    for feature, cell in rows.items():
        named = {int(n) for n in re.findall(r"#(\d+)", cell)}
        if GAP.search(cell) and not named & set(OPEN_ISSUES):
            wrong.append(f"{feature}: {cell!r} names no open issue (#{', #'.join(map(str, OPEN_ISSUES))})")
    assert wrong == []
    assert GAP.search("CUDA path, not yet measured") and not GAP.search("yes, token-level")


def test_the_readme_names_the_families_and_formats_the_code_has():
    """The families the intro and the vision row name are the architectures shoal registers, vision ones in the
    vision row; the K-quants the intro says run as stored are types with a kernel in the format registry."""
    from shoal.model import formats, registry

    assert set(README_FAMILIES) == set(registry.supported_architectures()), "a family without a name in the README"
    intro = readme_intro()
    text_named = re.search(r"runs (.+?) from Hugging Face", intro).group(1)
    text_named = set(re.split(r", | and ", text_named))
    vision_named = set(feature_rows()["vision input"].split(", "))
    vision = {arch for arch in README_FAMILIES if getattr(registry.model_class([arch]), "vision", None)}
    assert text_named == {n for arch in set(README_FAMILIES) - vision for n in README_FAMILIES[arch]}
    assert vision_named == {n for arch in vision for n in README_FAMILIES[arch]}
    quants = re.search(r"K-quants \(([^)]+)\)", intro).group(1).split(", ")
    assert quants and {re.sub(r"_[SML]$", "", q) for q in quants} <= {f.name for f in formats.NATIVE.values()}


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


# ---------------------------------------------------------------- the architecture pages name code that exists

ARCHITECTURE = DOCS / "architecture"
CODE_DIRS = ("shoal", "tests", "benchmarks", "tools")  # where a name the pages give may be defined
ROOT_DIRS = {"shoal", "tests", "benchmarks", "tools", "docs"}  # a path starting with one is from the repository root
# Code spans shaped like shoal's code that are not shoal's, each with its reason.
OUTSIDE_NAMES = {
    "APIRouter": "FastAPI's router, which a protocol package exports",
    "YamlConfigSettingsSource": "pydantic-settings' YAML source, which dependencies.md says shoal does not use",
    "GPTNeoXForCausalLM": "a transformers architecture shoal does not run: the unknown in a test",
    "GGML_NATIVE": "llama.cpp's cmake option, in how the peers are built",
    "vec_dot_q4_K_q8_K": "llama.cpp's dot product, which cpu.md says the kernels sum as",
    "type_traits": "ggml's per-type table, the model for the format registry",
    ".peers/": "the peers' environment, made by `make bench-peers` and ignored by git",
    "shared/DESIGN.md": "the project's design sketch, outside this repository",
    "tp.py": "gpt-fast's tensor-parallel file",
    "LLM.beam_search": "vLLM's, which index.md says shoal's beam search does not follow",
    "formats/": "the design sketch's package, which index.md says shoal does not have",
    "enable_gqa": "the keyword of torch's scaled_dot_product_attention",
    "_total": "Prometheus' counter suffix",
    "DecodeStream": "tokenizers' incremental decoder",
    "convert_gguf_tokenizer": "transformers' GGUF tokenizer converter",
    "ignore_merges": "an option of tokenizers' BPE model",
    "SyncBackend": "httpcore's network backend",
    "Host": "the HTTP header",
    "BertForSequenceClassification": "transformers' class a cross-encoder's folder names, which the encoder runs",
}
MODULE_ALIASES = {"nn": "torch.nn"}  # as shoal's files import them


def is_camel(name: str) -> bool:
    return bool(re.fullmatch(r"_?[A-Z]\w*", name)) and any(c.islower() for c in name)


def is_caps(name: str) -> bool:
    return bool(re.fullmatch(r"_?[A-Z][A-Z0-9_]+", name))


def is_snake(name: str) -> bool:
    """Shaped like a function, field or variable (asked after is_camel and is_caps)."""
    return "_" in name


class CodeIndex:
    """What shoal's Python (and tests, benchmarks, tools) defines, read with `ast`, and the words of its C++."""

    def __init__(self):
        self.modules: dict[str, set[str]] = {}  # dotted module -> its top-level names (imports too)
        self.top_level: set[str] = set()  # every module's top-level definitions (not imports)
        self.classes: dict[str, list[ast.ClassDef]] = {}  # class name -> its definitions
        self.functions: dict[str, list[ast.FunctionDef]] = {}  # function or method name -> its definitions
        self.defined: set[str] = set()  # every name bound anywhere: defs, classes, parameters, assignments, fields
        self.tests: set[str] = set()
        self.in_file: dict[Path, set[str]] = {}  # the names each file defines (a C++ file: its words)
        self.code: list[str] = []  # each of shoal's files as code, without comments or docstrings: for quoted snippets
        for top in CODE_DIRS:
            for path in sorted((ROOT / top).rglob("*.py")):
                self._read(path, top)
        kernels = [p for p in sorted((ROOT / "shoal" / "kernels").iterdir()) if p.suffix in (".cpp", ".h")]
        cpp = [re.sub(r"//[^\n]*|/\*.*?\*/", "", p.read_text(), flags=re.S) for p in kernels]
        self.cpp = set(re.findall(r"[A-Za-z_]\w*", "\n".join(cpp)))
        self.in_file |= {p: set(re.findall(r"[A-Za-z_]\w*", c)) for p, c in zip(kernels, cpp)}
        self.code += [re.sub(r"\s+", " ", c) for c in cpp]

    def _read(self, path: Path, top: str):
        tree = ast.parse(path.read_text())
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        own, imported, bound = set(), set(), set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                own |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
                if top == "tests":
                    self.tests.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                self.defined.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                bound.add(node.attr)
        self.modules[module] = own | imported
        self.top_level |= own
        self.defined |= bound
        self.in_file[path] = bound
        if top == "shoal":
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    node.body = body[1:] or [ast.Pass()]  # the docstring
            self.code.append(ast.unparse(tree))

    def quotes(self, snippet: str) -> bool:
        """Whether a file of shoal's has the snippet as code (`...` standing for anything)."""
        pieces = [p.strip() for p in re.sub(r"\s+", " ", snippet).split("...")]
        pattern = ".*?".join(re.escape(p) for p in pieces if p)
        return any(re.search(pattern, code) for code in self.code)

    def modules_named(self, dotted: str) -> list[str]:
        """Modules whose dotted name ends with `dotted` (`structured`, `engine.structured`, `shoal.engine.structured`)."""
        return [m for m in self.modules if m == dotted or m.endswith("." + dotted)]

    def class_attrs(self, name: str, seen=()) -> set[str] | None:
        """Everything a class of that name has: methods, class-level names, `self.x` it sets, its shoal bases' too."""
        if name not in self.classes or name in seen:
            return None
        attrs = set()
        for cls in self.classes[name]:
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    attrs.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    attrs |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            attrs |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
            for base in cls.bases:
                base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                attrs |= self.class_attrs(base_name, (*seen, name)) or set()
        return attrs

    def is_class(self, name: str) -> bool:
        """A class, or a type given a name at a module's top (`Int = Annotated[...]`)."""
        return name in self.classes or name in self.top_level

    def is_constant(self, name: str) -> bool:
        """Named at a module's top or in a class's body."""
        return name in self.top_level or any(
            name in {n.id for node in cls.body if isinstance(node, (ast.Assign, ast.AnnAssign)) for n in ast.walk(node)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for classes in self.classes.values() for cls in classes)


@functools.cache
def code_index() -> CodeIndex:
    return CodeIndex()


def without_fences(text: str) -> str:
    """The text with its fenced blocks (indented ones too) blanked, lines kept."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def code_spans(text: str):
    """(line, span) for each inline code span outside fenced blocks, its whitespace made single spaces."""
    text = without_fences(text)
    for m in re.finditer(r"`([^`]+)`", text):
        yield text.count("\n", 0, m.start()) + 1, re.sub(r"\s+", " ", m.group(1)).strip()


def outside_attr(parts: list[str]) -> bool | None:
    """Whether a dotted name resolves in an installed library (None: its head is no library)."""
    head = MODULE_ALIASES.get(parts[0], parts[0])
    if hasattr(builtins, head):
        obj = getattr(builtins, head)
    elif all(p.isidentifier() for p in head.split(".")) and head.split(".")[0] not in ROOT_DIRS \
            and importlib.util.find_spec(head.split(".")[0]) is not None:
        obj = importlib.import_module(head)
    else:
        return None
    for part in parts[1:]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def resolve_dotted(parts: list[str], idx: CodeIndex) -> str | None:
    """None when `a.b.c` names shoal code (module + attribute, or class + attribute), else why not."""
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
        modules = idx.modules_named(".".join(parts[:cut]))
        if modules:
            rest = parts[cut:]
            for m in modules:
                if rest[0] in idx.modules[m]:
                    cls = rest[0] if len(rest) > 1 and rest[0] in idx.classes else None
                    if cls is None or rest[1] in idx.class_attrs(cls):
                        return None
            return f"`{'.'.join(parts[:cut])}` ({', '.join(modules)}) defines no `{'.'.join(rest[:2])}`"
    if parts[0] in idx.classes:
        if parts[1] in idx.class_attrs(parts[0]):
            return None
        return f"class `{parts[0]}` has no `{parts[1]}`"
    found = outside_attr(parts)
    if found is not None:
        return None if found else f"`{'.'.join(parts)}` is not in that library"
    return f"`{parts[0]}` is neither a shoal module, a shoal class nor a library"


def check_name(name: str, idx: CodeIndex, called: bool = False) -> str | None:
    """A bare name: a CamelCase one is a class (or type), CAPS a constant, snake_case something shoal defines,
    test_* a test; a plain word is checked only when called."""
    if name in OUTSIDE_NAMES or hasattr(builtins, name):
        return None
    if name.startswith("test_"):
        return None if name in idx.tests else f"no test `{name}` in tests/"
    if is_camel(name):
        return None if idx.is_class(name) or name in idx.cpp else f"no class `{name}` in shoal"
    if is_caps(name):
        return None if idx.is_constant(name) or name in idx.cpp else f"no constant `{name}` in shoal"
    if is_snake(name) or called:
        return None if name in idx.defined or name in idx.cpp else f"shoal defines no `{name}`"
    return None


def check_keywords(func: str, keywords: list[str], idx: CodeIndex) -> str | None:
    """A call's keywords must be parameters of some definition of that function."""
    defs = idx.functions.get(func, [])
    for d in defs:
        params = {a.arg for a in d.args.args + d.args.kwonlyargs + d.args.posonlyargs}
        if d.args.kwarg is not None or set(keywords) <= params:
            return None
    return f"no `{func}` takes {', '.join(keywords)}" if defs and keywords else None


def signature_matches(node: ast.expr, idx: CodeIndex) -> bool:
    """`variable.method(a, b)`: some definition of `method` takes, after self, parameters named `a, b` first."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and not node.keywords
            and all(isinstance(a, ast.Name) for a in node.args)):
        return False
    names = [a.id for a in node.args]
    for d in idx.functions.get(node.func.attr, []):
        params = [a.arg for a in d.args.posonlyargs + d.args.args if a.arg not in ("self", "cls")]
        if params[:len(names)] == names:
            return True
    return False


def head_name(node: ast.expr) -> str | None:
    node = node.value if isinstance(node, ast.Await) else node
    node = node.func if isinstance(node, ast.Call) else node
    while isinstance(node, (ast.Attribute, ast.Call)):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node.id if isinstance(node, ast.Name) else None


def check_expression(node: ast.expr, idx: CodeIndex) -> str | None:
    if isinstance(node, ast.Await):
        node = node.value
    called = isinstance(node, ast.Call)
    func = node.func if called else node
    parts = []
    while isinstance(func, ast.Attribute):
        parts.insert(0, func.attr)
        func = func.value
    if isinstance(func, ast.Call):  # a call of a call's result: check the inner call
        return check_expression(func, idx)
    if not isinstance(func, ast.Name):
        return None  # arithmetic, shapes, literals: not a name
    parts.insert(0, func.id)
    why = check_name(parts[0], idx, called and len(parts) == 1) if len(parts) == 1 else resolve_dotted(parts, idx)
    if why is None and called:
        why = check_keywords(parts[-1], [k.arg for k in node.keywords if k.arg], idx)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if isinstance(arg, ast.Call) or isinstance(arg, ast.Name) and (is_caps(arg.id) or is_camel(arg.id)):
                why = why or check_expression(arg, idx)
    return why


PLACEHOLDER = re.compile(r"<[^<>]*>|\bNAME\b")
FILE = re.compile(r"[\w.*-]+\.(py|cpp|h|md|toml|sh|json|yaml|txt)")


def check_path(path: str, name: str | None, idx: CodeIndex) -> str | None:
    """`a/b.py` from shoal/ (or the repository root for tests/, benchmarks/, docs/, tools/); a bare file name
    anywhere in the repository; `dir/module.attr` a module's attribute; `file.py: name` a name the file defines."""
    if "/" not in path.rstrip("/"):
        if path.endswith("/"):
            found = [p for top in ("shoal", ".") for p in (ROOT / top).glob(path)]
        else:
            found = list(ROOT.glob(path)) + [p for top in CODE_DIRS + ("docs",) for p in (ROOT / top).rglob(path)]
        return None if found else f"no file `{path}` in the repository"
    if not path.endswith("/") and not FILE.fullmatch(path.rsplit("/", 1)[1]) and "." in path.rsplit("/", 1)[1]:
        module, _, attr = path.partition(".")  # runner/build.planned_pool_bytes
        return resolve_dotted([*module.split("/"), *attr.split(".")], idx)
    base = ROOT if path.split("/")[0] in ROOT_DIRS else ROOT / "shoal"
    found = list(base.glob(path.rstrip("/")))
    if not found:
        return f"no `{path}` in {'shoal/' if base != ROOT else 'the repository'}"
    if name is not None:
        module = ".".join(found[0].relative_to(ROOT).with_suffix("").parts)
        if name not in idx.modules.get(module, ()):
            return f"`{path}` defines no `{name}`"
    return None


def files_named(path: str) -> list[Path]:
    """A path as check_path reads it: from shoal/ or the repository root, or a bare name anywhere in the code."""
    if "/" not in path:
        return [p for top in CODE_DIRS for p in (ROOT / top).rglob(path)]
    return list((ROOT if path.split("/")[0] in ROOT_DIRS else ROOT / "shoal").glob(path))


# "`name` in `file.py`", "`name` (`file.py`)", "`name` from `file.py`": the file defines the name.
PLACED = re.compile(r"`([A-Za-z_]\w*)[\w.]*(?:\([^`]*\))?`\s+(?:in\s+|\(|from\s+)`([\w./-]+\.(?:py|cpp|h))`")


def check_placed(name: str, path: str, idx: CodeIndex) -> str | None:
    files = files_named(path)
    if not files or any(name in idx.in_file.get(f, ()) for f in files):
        return None  # a missing file is check_path's to report
    return f"`{path}` does not define `{name}`"


def check_span(span: str, idx: CodeIndex) -> str | None:
    """None when a code span is not shoal's code, or names shoal code that exists; else what is wrong."""
    if span in OUTSIDE_NAMES or span.startswith(("-", "/", "{", "[", '"', "'")):
        return None  # flags (checked above), routes (the HTTP reference), JSON, shapes, strings
    if span.startswith("shoal:"):  # a metric family
        families = {f.name for f in metrics.catalog()}
        return None if "<" in span or span in families | {"shoal:"} | {f"{f}_total" for f in families} else "no such metric"
    env = re.fullmatch(r"(SHOAL_[A-Z0-9_]+)(=.*)?", span)
    if env:
        return None if any(re.search(rf"[\"']{env.group(1)}[\"']", c) for c in idx.code) else f"shoal reads no ${env.group(1)}"
    shaped = PLACEHOLDER.sub("*", span)
    path = re.fullmatch(r"([\w.*/-]+)(?::\s*(\w+))?", shaped)
    if path and ("/" in path.group(1) or FILE.fullmatch(path.group(1))):
        return check_path(path.group(1), path.group(2), idx)
    try:
        node = ast.parse(re.sub(r"\.<[^<>]*>", "", span), mode="eval").body  # torch.ops.shoal_kernels.<op>
    except SyntaxError:
        call = re.match(r"[A-Za-z_][\w.]*(?=\()", span)  # linear(in, out): a call with words for arguments
        if call:
            return check_expression(ast.parse(call.group(0) + "()", mode="eval").body, idx)
        return None if "." not in span or " " in span or idx.quotes(span) else f"`{span}` is not in shoal's code"
    why = check_expression(node, idx)
    head = head_name(node)
    if why and head and head[0].islower() and (idx.quotes(span) or signature_matches(node, idx)):
        return None  # code quoted from shoal's, or a call on a variable with the method's own parameter names
    return why


def test_the_architecture_pages_name_only_code_that_exists():
    """Every code span on docs/architecture/ shaped like shoal's code names something that exists: a path, a
    module's or a class's attribute, a class, a constant, a function (with the keywords it is shown with), a test,
    an environment variable shoal reads, a metric. Names of other projects are in OUTSIDE_NAMES."""
    idx = code_index()
    wrong = []
    for page in sorted(ARCHITECTURE.glob("*.md")):
        text = page.read_text()
        for line, span in code_spans(text):
            why = check_span(span, idx)
            if why:
                wrong.append(f"{page.relative_to(ROOT)}:{line}: `{span}`: {why}")
        prose = without_fences(text)
        for m in PLACED.finditer(prose):
            why = check_placed(m.group(1), m.group(2), idx)
            line = prose.count("\n", 0, m.start()) + 1
            if why:
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {why}")
    assert not wrong, "\n".join(wrong)


def test_the_architecture_check_sees_what_it_should():
    idx = code_index()
    exist = ["engine/async_engine.py", "model/attention/", "shoal/model/<family>.py", "tests/tiny_models.py", "benchmarks/kernels.py",
             "server/chat/params.py: engine_requests", "runner/build.plan_part", "multimodal.pixel_digest", "AsyncEngine.check",
             "structured.LIMITS", "quant.WeightFormat.linear", "Engine.add_request(checked=True)", "KVBlockPool", "STACKED_PARAMS",
             "plan_tensor_parallel", "check()", "test_unknown_architecture_is_a_clear_error", "SHOAL_CPU_ISA=avx2", "shoal:http_requests",
             "asyncio.run", "nn.Module.__getattr__", "m.impl", "app.include_router(...)", "metadata.forward(q, k, v, kv, scale)"]
    assert [s for s in exist if check_span(s, idx)] == []
    moved = ["engine/async_engin.py", "model/attentions/", "tests/tiny_model.py", "server/chat/params.py: engine_request",
             "runner/build.plan_parts", "multimodal.pixel_hash", "AsyncEngine.chek", "structured.LIMIT", "quant.WeightFormat.linears",
             "Engine.add_request(check=True)", "KVBlockPools", "STACKED_PARAM", "plan_tensor_parallels", "chek()", "test_nothing_here",
             "SHOAL_CPU_ISAS", "shoal:http_request", "asyncio.runs", "state.admit(body.model)", "metadata.forward(q, v, k, kv, scale)"]
    assert [s for s in moved if not check_span(s, idx)] == []
    # what is not shaped like shoal's code is let be
    assert [s for s in ("--max-model-len", "/v1/cluster", "auto", "head_dim + 4", "make setup", "std::vector", '{"a": 1}')
            if check_span(s, idx)] == []
    assert check_placed("ServerCounters", "state.py", idx) and not check_placed("ServerCounters", "server/models.py", idx)
    assert list(code_spans("a `x`\n```\n`y`\n```\n  ```py\n`z`\n  ```\nb `w\n v`")) == [(1, "x"), (8, "w v")]
