// shoal's dashboard: polls /stats once a second and draws what it reports, as plain SVG.
// No library and no CDN: the page works offline, served by the server itself.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120; // points kept for the over-time charts
const KV_WARN = 0.8;
const SVG = "http://www.w3.org/2000/svg";
const history = [];
let lastRejected = null;
let selected = null;

const $ = (id) => document.getElementById(id);
const keyInput = $("key");
keyInput.value = localStorage.getItem("shoal-api-key") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("shoal-api-key", keyInput.value); poll(); });

function fmt(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function clear(svg) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const w = svg.clientWidth || 320, h = svg.clientHeight || 140;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  return [w, h];
}

// Bars: series is a list of {values: [...], color}; stacked when several.
function bars(svg, labels, series, title) {
  const [w, h] = clear(svg);
  const n = labels.length;
  const totals = labels.map((_, i) => series.reduce((s, x) => s + (x.values[i] || 0), 0));
  const max = Math.max(1e-9, ...totals);
  el("text", { x: 2, y: 10 }, svg).textContent = `max ${fmt(max, max < 10 ? 2 : 0)}`;
  if (!n) { el("text", { x: w / 2 - 30, y: h / 2 }, svg).textContent = "no data yet"; return; }
  const bw = (w - 4) / n;
  const named = n <= 6; // few bars: each gets its label underneath
  const bottom = named ? h - 14 : h - 2;
  labels.forEach((label, i) => {
    let y = bottom;
    if (named) el("text", { x: 2 + i * bw + bw / 2, y: h - 3, "text-anchor": "middle" }, svg).textContent = label;
    series.forEach((s) => {
      const v = s.values[i] || 0;
      const bh = (v / max) * (bottom - 14);
      const r = el("rect", { x: 2 + i * bw + 1, y: y - bh, width: Math.max(1, bw - 2), height: bh, fill: s.color,
                             "data-label": label, "data-value": v, class: "bar" }, svg);
      el("title", {}, r).textContent = `${label}: ${fmt(v, 3)}${title ? " " + title : ""}`;
      y -= bh;
    });
  });
}

// Lines over time: series is {key, color}; points come from `history`.
function lines(svg, series) {
  const [w, h] = clear(svg);
  const max = Math.max(1e-9, ...history.flatMap((p) => series.map((s) => p[s.key] || 0)));
  el("text", { x: 2, y: 10 }, svg).textContent = `max ${fmt(max, max < 10 ? 2 : 0)}`;
  if (history.length < 2) return;
  const dx = (w - 4) / (HISTORY - 1);
  const x0 = w - 2 - (history.length - 1) * dx;
  series.forEach((s) => {
    const pts = history.map((p, i) => `${(x0 + i * dx).toFixed(1)},${(h - 2 - ((p[s.key] || 0) / max) * (h - 16)).toFixed(1)}`);
    el("polyline", { points: pts.join(" "), fill: "none", stroke: s.color, "stroke-width": 2, class: "line", "data-key": s.key }, svg);
  });
}

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

// Several models: a table of them all, and the charts follow the one picked (the default model at first).
let chosen = null;
function renderModels(all) {
  const names = Object.keys(all.models || {});
  $("models").hidden = names.length < 2;
  const select = $("model-select");
  select.hidden = names.length < 2;
  if ([...select.options].map((o) => o.value).join("\n") !== names.join("\n")) {
    select.textContent = "";
    for (const n of names) select.add(new Option(n, n));
  }
  if (chosen === null || !names.includes(chosen)) chosen = all.model;
  select.value = chosen;
  const body = $("models-table").tBodies[0];
  body.textContent = "";
  for (const n of names) {
    const m = all.models[n];
    const tr = body.insertRow();
    tr.dataset.model = n;
    for (const v of [n, m.error ? `${m.status}: ${m.error}` : m.status, bytes(m.memory_bytes), fmt(m.in_flight),
                     fmt(m.total_requests), fmt(m.tokens_generated)]) tr.insertCell().textContent = v;
    tr.addEventListener("click", () => pick(n));
  }
}

function pick(name) {
  if (name === chosen) return;
  chosen = name;
  history.length = 0; // the charts over time start again for the model picked
  if (lastAll) { renderModels(lastAll); render(view(lastAll)); }
}

function view(all) {
  return (all.models && all.models[chosen]) || all;
}

function render(stats) {
  $("model").textContent = stats.model;
  $("status").textContent = stats.status;
  const tiles = {
    "tile-requests": stats.total_requests, "tile-generated": stats.tokens_generated, "tile-cached": stats.cached_prompt_tokens,
    "tile-disconnects": stats.client_disconnects, "tile-preemptions": stats.engine ? stats.engine.preemptions : null,
    "tile-errors": stats.failed_requests,
  };
  for (const [id, v] of Object.entries(tiles)) $(id).textContent = fmt(v);

  const usage = stats.cache_usage || 0;
  const rejected = stats.rejected_overloaded || 0;
  const warnings = [];
  if (usage > KV_WARN) warnings.push(`KV cache ${fmt(usage * 100, 0)}% full: new requests may wait or preempt others`);
  if (lastRejected !== null && rejected > lastRejected) warnings.push(`requests are being refused (503): ${fmt(rejected)} so far`);
  lastRejected = rejected;
  $("warning").hidden = warnings.length === 0;
  $("warning").textContent = warnings.join(" · ");

  lines($("chart-throughput"), [{ key: "prefill", color: css("--a") }, { key: "decode", color: css("--b") }]);
  lines($("chart-queue"), [{ key: "running", color: css("--a") }, { key: "waiting", color: css("--b") }]);

  const recent = (stats.recent_requests || []).slice().reverse(); // oldest first, left to right
  const ids = recent.map((r) => r.request_id);
  bars($("chart-ttft"), ids, [{ values: recent.map((r) => r.time_to_first_token || 0), color: css("--c") }], "s");
  bars($("chart-cache"), ids, [
    { values: recent.map((r) => r.cached_prompt_tokens), color: css("--a") },
    { values: recent.map((r) => r.computed_prompt_tokens), color: css("--b") },
  ], "tokens");

  const pc = stats.prefix_cache || {};
  const total = stats.kv_total_bytes || 0;
  bars($("chart-kv"), ["KV"], [
    { values: [stats.kv_used_bytes || 0], color: css("--a") },
    { values: [pc.cached_bytes || 0], color: css("--b") },
    { values: [Math.max(0, total - (stats.kv_used_bytes || 0) - (pc.cached_bytes || 0))], color: css("--line") },
  ], "bytes");
  $("kv-text").textContent = `${bytes(stats.kv_used_bytes)} held, ${bytes(pc.cached_bytes)} cached, of ${bytes(total)}`;
  bars($("chart-hits"), ["miss", "extension", "supersequence", "divergence"], [
    { values: [pc.misses || 0, pc.hits_extension || 0, pc.hits_supersequence || 0, pc.hits_divergence || 0], color: css("--d") },
  ], "lookups");

  const tier = stats.prefix_cache_tier;
  $("tier").hidden = !tier;
  if (tier) {
    bars($("chart-tier"), ["restored", "spilled", "evicted", "rejected"], [
      { values: [tier.restored_blocks, tier.spilled_blocks, tier.evictions, tier.rejected_entries], color: css("--c") },
    ], "blocks");
    $("tier-text").textContent = tier.enabled
      ? `${bytes(tier.bytes)} of ${bytes(tier.capacity_bytes)} on ${tier.kind === "disk" ? "disk" : "host RAM"}, ` +
        `${fmt(tier.hits)} admissions restored, ${bytes(tier.restored_bytes)} read back`
      : "off: the tier stopped taking blocks (see the server log)";
  }

  const vision = stats.vision;
  $("vision").hidden = !vision;
  if (vision) {
    bars($("chart-vision"), ["encoded", "cache hits"], [
      { values: [vision.images_encoded, vision.cache_hits], color: css("--a") },
    ], "images");
    $("vision-text").textContent = `${fmt(vision.images)} images in requests, ${fmt(vision.encode_seconds, 2)} s in the ` +
      `vision tower, ${fmt(vision.cached_images)} kept (${bytes(vision.cached_bytes)} of ${bytes(vision.capacity_bytes)})`;
  }

  const spec = stats.speculative;
  $("spec").hidden = !spec;
  if (spec) {
    bars($("chart-spec"), ["drafted", "accepted"], [
      { values: [spec.drafted_tokens, spec.accepted_tokens], color: css("--b") },
    ], "tokens");
    $("spec-text").textContent = `${spec.proposer} proposer: ${fmt(spec.drafts)} drafts, ` +
      `${(100 * spec.acceptance_rate).toFixed(1)}% of drafted tokens accepted, ${fmt(spec.steps_off)} steps too busy to draft`;
  }

  const body = $("requests").tBodies[0];
  body.textContent = "";
  for (const r of stats.recent_requests || []) {
    const tr = body.insertRow();
    tr.dataset.id = r.request_id;
    const tps = r.decode_time > 0 ? (r.generated_tokens - 1) / r.decode_time : null;
    for (const v of [r.request_id, fmt(r.time_to_first_token, 3), fmt(r.prompt_tokens), fmt(r.cached_prompt_tokens),
                     fmt(r.generated_tokens), fmt(tps, 1), r.finish_reason || "–"]) tr.insertCell().textContent = v;
    tr.addEventListener("click", () => { selected = r.request_id; showDetail(stats); });
  }
  showDetail(stats);
}

function showDetail(stats) {
  const r = (stats.recent_requests || []).find((x) => x.request_id === selected);
  $("detail").hidden = !r;
  if (r) $("detail").textContent = JSON.stringify(r, null, 2);
}

let lastStats = null; // what the charts show: the model picked
let lastAll = null; // /stats as it came
async function poll() {
  if (document.body.dataset.auth === "required" && !keyInput.value) {
    $("status").textContent = "enter the API key";
    return;
  }
  const headers = keyInput.value ? { Authorization: `Bearer ${keyInput.value}` } : {};
  try {
    const resp = await fetch("/stats", { headers });
    if (resp.status === 401) { $("status").textContent = "API key needed"; return; }
    if (!resp.ok) { $("status").textContent = `error ${resp.status}`; return; }
    lastAll = await resp.json();
    renderModels(lastAll);
    lastStats = view(lastAll);
    const tp = lastStats.throughput || { prompt_tokens_per_s: {}, generation_tokens_per_s: {} };
    history.push({ prefill: tp.prompt_tokens_per_s["10s"] || 0, decode: tp.generation_tokens_per_s["10s"] || 0,
                   running: lastStats.active_requests || 0, waiting: lastStats.waiting_requests || 0 });
    while (history.length > HISTORY) history.shift();
    render(lastStats);
    document.body.dataset.updated = String(Date.now());
  } catch (e) {
    $("status").textContent = "server unreachable";
  }
}

window.addEventListener("resize", () => { if (lastStats) render(lastStats); });
$("model-select").addEventListener("change", (e) => pick(e.target.value));
poll();
setInterval(poll, POLL_MS);
