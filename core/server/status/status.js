// The status page: reads /status/events (server-sent events) and draws what they say.
// Elements with data-metric show the value /metrics shows under that name, in data-value.
"use strict";

const SPAN_S = 300;
const STATES = ["live", "store", "promised", "free"];
let points = [];  // {t, pool, counters} oldest first
let lastStreams = new Map();  // request id -> {t, generated}: for each stream's tokens/s

const $ = (sel) => document.querySelector(sel);
const fmt = (n) => (n === null || n === undefined) ? "" :
  Number.isInteger(n) ? n.toLocaleString("en-US") : n.toFixed(n < 10 ? 2 : 1);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

function setMetric(name, value) {
  for (const e of document.querySelectorAll(`[data-metric="${CSS.escape(name)}"]`)) {
    e.dataset.value = String(value);
    e.textContent = fmt(value);
  }
}

function bytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${i ? b.toFixed(b < 10 ? 2 : 1) : b} ${units[i]}`;
}

function seconds(s) {
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

// -- what the server says once: the model and the plan -----------------------------------

function hello(h) {
  $("#model").textContent = h.model;
  $("#plan-line").textContent = h.plan.line;
  const p = h.plan, a = h.asked || {};
  const gib = bytes;
  const or = (v, unset) => (v === null || v === undefined) ? unset : v;
  // [what, asked, planned]
  const rows = [
    ["lanes", `--parallel ${or(a.parallel, "")}`, p.lanes],
    ["window", `--context ${or(a.context, "(the model's)")}`, fmt(p.window)],
    ["paging", `TF_KV_PAGES ${or(a.kv_pages, "")}`, p.mode],
    ["prompt cache", `--prompt-cache-gib ${or(a.prompt_cache_gib, "")}`, p.store_on ? gib(p.cache_bytes) : "off"],
    ["kept states", `TF_KV_SHARE ${or(a.kv_share, "(sized by the plan)")}`, p.store_on ? (p.states || "not counted") : "off"],
    ["memory", a.memory_limit_gib ? `TF_MEMORY_LIMIT_GIB ${a.memory_limit_gib}` : "", `${gib(p.pages * p.page_bytes + p.lanes * p.fixed_bytes + p.cache_bytes + p.snapshot_bytes)} (${gib(p.left_bytes)} left)`],
    ["pages", "", `${fmt(p.pages)} × ${fmt(p.page_rows)} rows`],
    ["their bytes", "", gib(p.pages * p.page_bytes)],
    ["whole windows held", "", fmt(p.windows_held)],
    ["fixed state a lane", "", gib(p.fixed_bytes)],
    ["snapshot arena", "", gib(p.snapshot_bytes)],
    ["pass", "", `${fmt(p.pass_rows)} rows`],
  ];
  if (p.ranks > 1) rows.push(["tensor-parallel ranks", "", p.ranks]);
  $("#plan-table").replaceChildren(
    el("tr", {}, el("th", {}, ""), el("th", {}, "asked"), el("th", {}, "planned")),
    ...rows.map(([k, asked, got]) => el("tr", {}, el("th", {}, k), el("td", {class: "asked"}, asked), el("td", {}, got))));
}

// -- every summary ----------------------------------------------------------------------

function summary(s) {
  points.push(s.point);
  while (points.length && points[0].t < s.t - SPAN_S) points.shift();
  const pool = s.pool, c = s.counters;
  for (const k of ["free", "promised", "live", "shared", "store", "total"]) setMetric(`tensorfold_pool_pages{state=${k}}`, pool[k]);
  $("#host").textContent = pool.host ? `free ${fmt(pool.host.free)} · store ${fmt(pool.host.store)} · total ${fmt(pool.host.total)}` : "none";
  drawBar(pool);
  drawPoolChart();
  const census = $("#census");
  census.textContent = pool.idle ? (pool.even ? pool.census : "UNEVEN " + pool.census) : "busy: the census is taken when the engine goes idle";
  census.classList.toggle("bad", pool.idle && !pool.even);
  setMetric("tensorfold_uneven_total", c.uneven);
  setMetric("tensorfold_draft_tokens_total", c.tokens_drafted);
  setMetric("tensorfold_draft_tokens_accepted_total", c.drafts_accepted);
  $("#uneven").classList.toggle("bad", c.uneven > 0);

  setMetric("tensorfold_generation_tokens_total", c.generation_tokens);
  setMetric("tensorfold_requests_total", c.requests);
  setMetric("tensorfold_prompt_tokens_total{source=cached}", c.prompt_cached);
  setMetric("tensorfold_prompt_tokens_total{source=computed}", c.prompt_computed);
  $("#passes").textContent = fmt(c.passes);
  $("#replays").textContent = fmt(c.graph_replays);
  drawRates();

  setMetric("tensorfold_lanes{state=busy}", s.lanes.busy);
  $("#lanes-total").textContent = s.lanes.total;
  $("#lanes-pages").textContent = fmt(s.lanes.pages);
  $("#lanes-pages").dataset.value = String(s.lanes.pages);
  drawStreams(s.lanes.streams, s.t);
  setMetric("tensorfold_requests_waiting", s.waiting.count);
  $("#waiting").replaceChildren(...s.waiting.requests.map((r) => el("tr", {},
    el("td", {}, r.id), el("td", {}, fmt(r.prompt)), el("td", {}, fmt(r.max_tokens)),
    el("td", {}, r.choices), el("td", {}, seconds(r.age_s)))));
  if (s.waiting.count > s.waiting.requests.length) {
    $("#waiting").append(el("tr", {}, el("td", {colspan: 5, class: "muted"}, `and ${s.waiting.count - s.waiting.requests.length} more`)));
  }
  drawStore(s.store);
  const updated = $("#updated");
  updated.dataset.seq = s.seq;
  updated.textContent = `updated ${new Date(s.t * 1000).toLocaleTimeString()}`;
}

// free + live + store == total; promised pages are free pages already promised, so the bar's
// free part is those not promised.
function drawBar(pool) {
  const bar = $("#pool-bar");
  bar.replaceChildren(...STATES.map((k) => {
    const part = el("div", {class: k, title: `${k}: ${pool[k]}`});
    part.style.flexGrow = k === "free" ? Math.max(0, pool.free - pool.promised) : pool[k];
    return part;
  }));
}

// Pages held, stacked (live at the bottom), scaled to the most held in the span: a pool that
// is mostly free would leave them a sliver.
function drawPoolChart() {
  const svg = $("#pool-chart");
  if (points.length < 2) return svg.replaceChildren();
  const held = ["live", "store", "promised"];
  const t1 = points[points.length - 1].t, t0 = t1 - SPAN_S;
  const top = Math.max(1, ...points.map((p) => held.reduce((a, k) => a + p.pool[k], 0)));
  $("#pool-top").textContent = fmt(top);
  const x = (t) => ((t - t0) / SPAN_S) * 600, y = (v) => 140 - (v / top) * 136;
  const paths = [];
  let below = points.map(() => 0);
  for (const k of held) {
    const above = points.map((p, i) => below[i] + p.pool[k]);
    const up = points.map((p, i) => `${x(p.t).toFixed(1)},${y(above[i]).toFixed(1)}`);
    const down = points.map((p, i) => `${x(p.t).toFixed(1)},${y(below[i]).toFixed(1)}`).reverse();
    paths.push(svgEl("polygon", {points: up.concat(down).join(" "), class: k}));
    below = above;
  }
  svg.replaceChildren(...paths);
}

function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// The counters' change over the last `span` seconds: [newest, the oldest point within span].
function window_(span) {
  const last = points[points.length - 1];
  const first = points.find((p) => p.t >= last.t - span) || last;
  return [last, first];
}

function rate(key, span) {
  const [b, a] = window_(span);
  return b.t > a.t ? (b.counters[key] - a.counters[key]) / (b.t - a.t) : null;
}

function drawRates() {
  for (const e of document.querySelectorAll("[data-rate]")) {
    const [key, span] = e.dataset.rate.split(":");
    const r = rate(key, Number(span));
    e.textContent = r === null ? "–" : fmt(Math.round(r * 10) / 10);
  }
  for (const e of document.querySelectorAll("[data-ttft]")) {
    const [b, a] = window_(Number(e.dataset.ttft));
    const n = b.counters.ttft_count - a.counters.ttft_count;
    e.textContent = n > 0 ? seconds((b.counters.ttft_sum - a.counters.ttft_sum) / n) : "–";
  }
  for (const e of document.querySelectorAll("[data-hits]")) {
    const [b, a] = window_(Number(e.dataset.hits));
    const cached = b.counters.rows_cached - a.counters.rows_cached;
    const all = cached + b.counters.rows_computed - a.counters.rows_computed;
    e.textContent = all > 0 ? `${(100 * cached / all).toFixed(1)} %` : "–";
  }
  for (const e of document.querySelectorAll("[data-accept]")) {
    const [b, a] = window_(Number(e.dataset.accept));
    const drafted = b.counters.tokens_drafted - a.counters.tokens_drafted;
    const kept = b.counters.drafts_accepted - a.counters.drafts_accepted;
    e.textContent = drafted > 0 ? `${(100 * kept / drafted).toFixed(1)} % of ${fmt(drafted)}` : "–";
  }
  const svg = $("#rate-chart");
  if (points.length < 2) return svg.replaceChildren();
  const t1 = points[points.length - 1].t, t0 = t1 - SPAN_S;
  const rates = points.slice(1).map((p, i) => [p.t, Math.max(0, (p.counters.tokens_out - points[i].counters.tokens_out) / Math.max(p.t - points[i].t, 1e-3))]);
  const top = Math.max(1, ...rates.map((r) => r[1]));
  const line = rates.map(([t, r]) => `${((t - t0) / SPAN_S * 600).toFixed(1)},${(98 - r / top * 94).toFixed(1)}`);
  svg.replaceChildren(svgEl("polyline", {points: line.join(" "), class: "rate"}));
  $("#rate-top").textContent = fmt(Math.round(top));
}

function drawStreams(streams, t) {
  const seen = new Map();
  $("#streams").replaceChildren(...streams.map((s) => {
    const before = lastStreams.get(s.id);
    seen.set(s.id, {t, generated: s.generated});
    const tps = before && t > before.t ? (s.generated - before.generated) / (t - before.t) : null;
    const phase = s.phase === "prefill" ? `prefill pass ${s.pass} of ${s.passes}` : "decode";
    return el("tr", {"data-phase": s.phase, "data-request": s.id},
      el("td", {}, s.id + (s.choices > 1 ? ` (+${s.choices - 1} choices)` : "")), el("td", {}, s.slot),
      el("td", {class: s.phase}, phase), el("td", {}, fmt(s.prompt)), el("td", {}, fmt(s.cached)),
      el("td", {"data-generated": s.generated}, `${fmt(s.generated)} / ${fmt(s.max_tokens)}`),
      el("td", {}, tps === null ? "–" : fmt(Math.round(tps * 10) / 10)),
      el("td", {}, `${s.pages} (+${s.promised})`), el("td", {}, seconds(s.age_s)));
  }));
  if (!streams.length) $("#streams").append(el("tr", {}, el("td", {colspan: 9, class: "muted"}, "no stream on a lane")));
  lastStreams = seen;
}

function drawStore(store) {
  $("#store-off").hidden = store !== null;
  $("#store-nums").hidden = store === null;
  if (store === null) return $("#tree").replaceChildren();
  setMetric("tensorfold_prompt_store_states", store.states);
  setMetric("tensorfold_prompt_store_evictions_total", store.evictions);
  $("#store-device").textContent = fmt(store.on_device);
  $("#store-max-states").textContent = fmt(store.max_states);
  $("#store-pages").textContent = fmt(store.pages);
  $("#store-max-pages").textContent = fmt(store.max_pages);
  $("#store-host").textContent = `${fmt(store.on_host)} states, ${fmt(store.host_hits)} hits, ${fmt(store.host_evictions)} dropped`;
  const nodes = store.tree.flatMap((root) => root.children);
  const tree = nodes.length ? el("ul", {}, ...nodes.map(node)) : el("p", {class: "muted"}, "nothing kept");
  const left = store.nodes_left_out ? [el("p", {class: "muted"}, `${store.nodes_left_out} more nodes not shown`)] : [];
  $("#tree").replaceChildren(tree, ...left);
}

function node(n) {
  const k = n.kept;
  const label = el("span", {class: k ? "kept" : "inner"}, `+${fmt(n.tokens)} → ${fmt(n.depth)} tokens`);
  const info = k ? el("span", {class: "muted"}, ` · ${k.pages} page${k.pages === 1 ? "" : "s"}${k.snapshot ? " + snapshot" : ""}${k.host ? " · host" : ""} · ${k.hits} hit${k.hits === 1 ? "" : "s"} · used ${seconds(k.idle_s)} ago`) : "";
  return el("li", {}, label, info, ...(n.children.length ? [el("ul", {}, ...n.children.map(node))] : []));
}

// -- the stream --------------------------------------------------------------------------

function connect() {
  const link = $("#link");
  const source = new EventSource("/status/events");
  source.addEventListener("hello", (e) => hello(JSON.parse(e.data)));
  source.addEventListener("history", (e) => { points = JSON.parse(e.data).points; });
  source.onmessage = (e) => summary(JSON.parse(e.data));
  source.onopen = () => { link.textContent = "live"; link.dataset.state = "live"; };
  source.onerror = () => { link.textContent = "reconnecting"; link.dataset.state = "down"; };
}

connect();
