"""The package's shape: imports point one way. A circle means two modules each need the other to be understood
(and one of them is half-initialized while the other loads)."""

import ast
from pathlib import Path

import shoal

PACKAGE = Path(shoal.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Every shoal module -> the shoal modules it imports, at any depth (a lazy import inside a function counts).
    `from pkg import name` counts `pkg.name` where that is a module, else `pkg`; a package's own __init__, which
    Python runs before any of its modules, is not counted as a dependency of them."""
    modules = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = f
    graph = {m: set() for m in modules}
    for m, f in modules.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [x for x in subs if x in modules] + ([base] if any(x not in modules for x in subs) else [])
            else:
                continue
            for n in names:
                while n and n not in modules:
                    n = n.rpartition(".")[0]
                if n and n != m and not m.startswith(n + "."):
                    graph[m].add(n)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    graph = _imports()
    assert "shoal.engine.engine" in graph and "shoal.engine.scheduler" in graph["shoal.engine.engine"]  # it reads the code
    assert _circles(graph) == []


def test_dependencies_run_one_way_from_engine_to_executor_to_runner():
    graph = _imports()
    runner = {m for m in graph if m.startswith("shoal.runner")}
    executor = {m for m in graph if m.startswith("shoal.executor")}
    assert not any(d.startswith(("shoal.engine", "shoal.executor", "shoal.server")) for m in runner for d in graph[m])
    assert not any(d.startswith(("shoal.engine", "shoal.server")) for m in executor for d in graph[m])


def test_the_layers_are_single_rank_math():
    """Tensor parallelism is applied to the model built whole (model/tensor_parallel.py): no layer takes a split."""
    import inspect

    from shoal.model import layers

    graph = _imports()
    assert "shoal.model.tensor_parallel" not in graph["shoal.model.layers"]
    assert graph["shoal.model.tensor_parallel"] >= {"shoal.model.layers"}
    for cls in (layers.Attention, layers.MLP, layers.DecoderLayer, layers.DecoderModel, layers.DecoderForCausalLM):
        assert "tp" not in inspect.signature(cls.__init__).parameters, cls.__name__


def test_every_benchmark_imports_names_the_package_has():
    """The benchmarks run outside the suite: a name moved in the package must not leave one of them broken."""
    import importlib

    missing = []
    for f in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shoal" and not node.level:
                module = importlib.import_module(node.module)
                missing += [f"{f.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert missing == []


def _third_party_imports() -> dict[str, set[str]]:
    """Every top-level module the package imports from outside the standard library -> the files importing it."""
    import sys

    found: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top != "shoal" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(f.relative_to(PACKAGE.parent)))
    return found


def test_every_imported_library_is_a_declared_dependency():
    """A library the package imports comes from a distribution pyproject.toml's `dependencies` names, not from one
    that only happens to be installed because another pulls it in (fastapi pulls starlette and pydantic, httpx
    pulls httpcore: their next release may not). An import of an optional library would belong in an extra and a
    try/except ImportError; there is none."""
    import importlib.metadata
    import re
    import tomllib

    def canonical(name: str) -> str:  # PEP 503: Jinja2 and jinja2, PyYAML and pyyaml are one distribution
        return re.sub(r"[-_.]+", "-", name).lower()

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    declared = {canonical(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in project["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "yaml", "PIL"} <= set(imports)  # it reads the code
    undeclared = {top: sorted(files) for top, files in imports.items()
                  if not {canonical(d) for d in providers.get(top, [])} & declared}
    assert undeclared == {}, f"imported, but no distribution in pyproject.toml's dependencies provides them: {undeclared}"


def test_the_server_reaches_the_engine_only_through_its_door():
    """Nothing under server/ imports engine/, runner/ or executor/ but engine/async_engine.py (the door), and
    every attribute it reads of an engine is one the door offers (no `engine.runner...`)."""
    from shoal.engine.async_engine import AsyncEngine

    graph = _imports()
    server = {m for m in graph if m.startswith("shoal.server")}
    reached = {(m, d) for m in server for d in graph[m] if d.startswith(("shoal.engine", "shoal.runner", "shoal.executor"))}
    assert {d for _, d in reached} == {"shoal.engine.async_engine"}, sorted(reached)

    door = {name for name in dir(AsyncEngine) if not name.startswith("_")} | {"ready"}  # its one public attribute, the
    # build's future; the Engine it holds (`.engine`) is for tests and embedders, never the server
    through = []
    for f in (PACKAGE / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            named_engine = (isinstance(owner, ast.Attribute) and owner.attr == "engine") or (isinstance(owner, ast.Name) and owner.id == "engine")
            if named_engine and node.attr not in door:
                through.append(f"{f.relative_to(PACKAGE)}:{node.lineno}: engine.{node.attr}")
    assert through == []
    assert {"generate", "abort", "check", "tokenizer", "prepare_image", "failure", "cluster", "snapshot"} <= door


def test_the_offline_api_imports_nothing_of_the_server():
    graph = _imports()
    seen, todo = set(), ["shoal.engine.llm"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert not {m for m in seen if m.startswith("shoal.server")}
