"""The observability guide's stack, for real: the Grafana dashboard in docs/guides/ and the guide's
Prometheus config and queries against a live shoal.

- Fast: the dashboard's JSON is well formed (unique ids, titles, targets, a datasource variable,
  no overlapping panels), and every metric its PromQL names is one a live server's /metrics serves,
  used as its type allows (counters and histograms through rate(), gauges not); every shoal family
  the server serves is on some panel.
- Real: Debian's `prometheus` binary (installed by `make setup` when missing) scrapes a live shoal once
  a second with the guide's bearer-key config; after real OpenAI-SDK traffic, every panel's query and
  every query of the guide returns a non-empty result of finite numbers through Prometheus' HTTP API.
  Without the binary the test skips, and under CI=true it fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server_utils import LiveServer, tiny_engine
from shoal.server import ServerSettings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "guides" / "grafana-dashboard.json"
GUIDE = ROOT / "docs" / "guides" / "observability.md"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
KEY = "sk-observability-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEADLINE_S = 60

METRIC = re.compile(r"(?:\b([a-z_]+)\(\s*)?\b((?:shoal:|process_|python_)[a-zA-Z_:0-9]*)")
RATE_FUNCTIONS = {"rate", "irate", "increase"}


# ------------------------------------------------------------------ helpers


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def guide_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)


def guide_queries() -> list[str]:
    """The PromQL lines of the guide's `promql` blocks (one query per line, `#` lines are comments)."""
    return [line.strip() for block in guide_blocks("promql") for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def concrete(expr: str) -> str:
    """A dashboard expression as Grafana would send it: its variables and intervals filled in."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "1m")
    expr = re.sub(r'=~\s*"\$\{?\w+\}?"', '=~".+"', expr)  # every template variable: all values
    assert "$" not in expr, expr
    return expr


def scrape(srv) -> tuple[dict[str, str], set[str], dict[str, float]]:
    """{family: type}, the series names and {series labelled by model_name alone: value} of a /metrics scrape (a
    request histogram's series summed over its `protocol` label)."""
    with srv.http() as h:
        r = h.get("/metrics", headers=AUTH)
    assert r.status_code == 200, r.text
    families, series, values = {}, set(), {}
    for f in text_string_to_metric_families(r.text):
        families[f.name] = f.type
        for s in f.samples:
            series.add(s.name)
            if not {k for k in s.labels if k not in ("model_name", "protocol")}:  # one model: its series is the server's
                values[s.name] = values.get(s.name, 0.0) + s.value
    return families, series, values


def family_of(name: str, families: dict[str, str]) -> str | None:
    """The family a PromQL series name belongs to (`_bucket`/`_sum`/`_count` of a histogram, `_total` of a counter)."""
    for suffix, types in (("_bucket", {"histogram"}), ("_sum", {"histogram", "summary"}), ("_count", {"histogram", "summary"}),
                          ("_total", {"counter"})):
        if name.endswith(suffix) and families.get(name.removesuffix(suffix)) in types:
            return name.removesuffix(suffix)
    return name if families.get(name) in ("gauge", "info", "unknown") else None


def send_traffic(srv) -> None:
    """Real requests through the OpenAI SDK: a prompt repeated (prefix-cache hits), a conversation that
    grows (another hit), a stream, two at once (a batch), and a 400."""
    client = srv.openai(api_key=KEY)
    model = srv.state.model_name
    extra = {"ignore_eos": True}
    convo = [{"role": "user", "content": "Tell me about the sea, the same question three times."}]
    replies = [client.chat.completions.create(model=model, messages=convo, max_tokens=6, temperature=0.0, extra_body=extra) for _ in range(3)]
    assert replies[-1].usage.prompt_tokens_details.cached_tokens > 0
    grown = convo + [{"role": "assistant", "content": replies[0].choices[0].message.content or "x"},
                     {"role": "user", "content": "And about rivers?"}]
    client.chat.completions.create(model=model, messages=grown, max_tokens=6, temperature=0.0, extra_body=extra)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Stream a short answer."}],
                                            max_tokens=6, stream=True, extra_body=extra)
    assert sum(1 for _ in stream) > 1
    with ThreadPoolExecutor(2) as pool:  # two at once: a batch of two
        together = [pool.submit(client.chat.completions.create, model=model, messages=[{"role": "user", "content": f"Question number {i}."}],
                                max_tokens=8, extra_body=extra) for i in range(2)]
        assert all(f.result(DEADLINE_S).usage.completion_tokens == 8 for f in together)
    with srv.http() as h:
        assert h.post("/v1/chat/completions", headers=AUTH, json={"messages": convo, "temperature": -1}).status_code == 400


@pytest.fixture(scope="module")
def srv(tiny_llama_path, tmp_path_factory):
    # with the prefix cache's second tier, so that its metrics are served too
    engine = tiny_engine(tiny_llama_path, max_model_len=256, prefix_cache_dir=str(tmp_path_factory.mktemp("tier")))
    with LiveServer(engine, ServerSettings(log_requests=False, api_key=KEY)) as s:
        yield s


# ------------------------------------------------------------------ the dashboard, fast


def test_the_dashboard_is_well_formed():
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["title"] and d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "label_values(shoal:" in variables["instance"]["definition"]
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = {}
    for p in panels:
        assert p.get("title"), p["id"]
        assert p["targets"], f"panel {p['title']!r} has no target"
        assert p["datasource"]["uid"] == "${datasource}" and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells.get((x, y))!r} and {p['title']!r} overlap"
                cells[(x, y)] = p["title"]


def test_the_dashboard_names_only_metrics_shoal_serves(srv):
    send_traffic(srv)  # histograms, labelled counters and the last step's gauges appear with traffic
    families, series, _ = scrape(srv)
    # families this server declares with no series: labelled by what the model lacks (a model without experts)
    empty = set(families) - {family_of(s, families) for s in series}
    used = set()
    for title, expr in panel_targets():
        found = list(METRIC.finditer(expr))
        assert found, f"{title!r}: {expr} names no metric"
        for m in found:
            function, name = m.groups()
            family = family_of(name, families)
            assert family is not None, f"{title!r}: {name} belongs to no family"
            assert name in series or family in empty, f"{title!r}: {name} is not a series /metrics serves"
            counted = families[family] in ("counter", "histogram", "summary")
            assert (function in RATE_FUNCTIONS) == counted, f"{title!r}: {function or 'no function'} over the {families[family]} {name}"
            assert expr[m.end():].startswith('{instance=~"$instance"'), f"{title!r}: {name} is not filtered by $instance"
            if name.endswith("_bucket"):
                assert re.search(rf"histogram_quantile\(0?\.\d+, sum by \(le\) \(rate\({re.escape(name)}\b", expr), f"{title!r}: {expr}"
            used.add(family)
    missing = {f for f in families if f.startswith("shoal:")} - used
    assert not missing, f"shoal serves metrics no panel shows: {sorted(missing)}"
    for query in guide_queries():  # the guide's queries name real series too
        for _, name in METRIC.findall(query):
            assert name in series, f"the guide's {query} names {name}, which /metrics does not serve"


# ------------------------------------------------------------------ Prometheus, for real


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_config(port: int, key_file: Path, block: str) -> dict:
    """One of the guide's prometheus.yml blocks, pointed at the test's server, once a second."""
    cfg = yaml.safe_load(block)
    cfg["global"] = {**cfg.get("global", {}), "scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(key_file)
    return cfg


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10, trust_env=False)

    def query(self, expr: str) -> list:
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        result = body["data"]["result"]
        return [result] if body["data"]["resultType"] == "scalar" else result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_until(self, cond, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not cond():
            if time.monotonic() > deadline:
                targets = self.http.get("/api/v1/targets").json()["data"]["activeTargets"]
                raise AssertionError(f"timed out waiting for {what}; targets: {[(t['health'], t['lastError']) for t in targets]}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def prometheus(srv, tmp_path_factory):
    if PROMETHEUS is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Prometheus is missing: `make setup` installs Debian's prometheus package")
        pytest.skip("Prometheus is not installed (`make setup` installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    key_file = tmp / "shoal-api-key"
    key_file.write_text(KEY + "\n")
    blocks = [b for b in guide_blocks("yaml") if "scrape_configs" in b]
    assert len(blocks) >= 2 and any("authorization" in b for b in blocks), "the guide shows a plain and a keyed prometheus.yml"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    for i, block in enumerate(blocks):  # every config the guide shows is one Prometheus accepts
        path = tmp / f"guide-{i}.yml"
        path.write_text(yaml.safe_dump(scrape_config(srv.port, key_file, block)))
        if PROMTOOL:
            check = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=30, env=env)
            assert check.returncode == 0, f"promtool rejects the guide's config:\n{block}\n{check.stdout}{check.stderr}"
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(srv.port, key_file, next(b for b in blocks if "authorization" in b))))
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert proc.poll() is None, f"prometheus exited: {(tmp / 'prometheus.log').read_text()}"
            try:
                if prom.http.get("/-/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)
        yield prom
    finally:
        prom.http.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_every_panel_and_guide_query_has_data_in_prometheus(srv, prometheus):
    prom = prometheus
    # every series there before the traffic (the prefix cache's and the last step's appear with the first
    # request), and a baseline: rates need two samples that differ
    srv.openai(api_key=KEY).chat.completions.create(model=srv.state.model_name, messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
    prom.wait_until(lambda: (prom.value('count_over_time(shoal:model_loaded{job="shoal"}[1m])') or 0) >= 2, "two scrapes of shoal")
    assert prom.value('up{job="shoal"}') == 1
    send_traffic(srv)
    families, series, now = scrape(srv)
    none_here = set(families) - {family_of(s, families) for s in series}  # declared, no series for this model (experts)
    done = now["shoal:e2e_request_latency_seconds_count"]
    generated = now["shoal:generation_tokens_total"]
    prom.wait_until(lambda: prom.value("sum(shoal:e2e_request_latency_seconds_count)") == done
                    and prom.value("shoal:generation_tokens_total") == generated, "Prometheus to scrape the traffic")

    # the dashboard's instance variable lists this server
    r = prom.http.get("/api/v1/label/instance/values", params={"match[]": "shoal:model_loaded"})
    assert f"127.0.0.1:{srv.port}" in r.json()["data"]

    queries = [(title, concrete(expr)) for title, expr in panel_targets()] + [("the guide", q) for q in guide_queries()]
    queries = [(t, q) for t, q in queries if not {family_of(n, families) for _, n in METRIC.findall(q)} & none_here]
    assert len(queries) > 40
    empty, not_finite = [], []
    for title, expr in queries:
        result = prom.query(expr)
        if not result:
            empty.append(f"{title}: {expr}")
        for sample in result:
            value = float(sample["value"][1] if isinstance(sample, dict) else sample[1])
            if not math.isfinite(value):
                not_finite.append(f"{title}: {expr} {sample.get('metric', {}) if isinstance(sample, dict) else ''} = {value}")
    assert not empty and not not_finite, ("queries with no data:\n" + "\n".join(empty) + "\n"
                                          "queries with values that are not finite:\n" + "\n".join(not_finite))
