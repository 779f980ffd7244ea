// kvlab cache explorer: polls GET /v1/cache/state and draws the block pool, the prefix tree, the running
// requests and the prefix-cache hit rate over time. No build step, no dependencies.
// With an API key, open the page as /#key=YOUR_KEY; to see a tenant's salted blocks, add &salt=CACHE_SALT.
"use strict";

const POLL_MS = 1000;
const HISTORY = 120;
const fragment = new URLSearchParams(location.hash.slice(1));
const key = fragment.get("key");
const salt = fragment.get("salt");
const STATE_URL = salt ? `/v1/cache/state?cache_salt=${encodeURIComponent(salt)}` : "/v1/cache/state";
const history = [];   // {t, queries, hits}
let refreshes = 0;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child);
  return node;
}

function humanBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function pct(x) { return `${(100 * x).toFixed(1)}%`; }

function blockState(b) { return b.ref_count > 0 ? "used" : "cached"; }

function renderSummary(s) {
  const st = s.stats || {};
  $("model").textContent = `${s.model || ""} · block_size ${s.block_size}`;
  $("usage").textContent = pct(st.kv_cache_usage || 0);
  $("queue").textContent = `${st.num_running || 0} / ${st.num_waiting || 0}`;
  $("hitrate").textContent = st.prefix_cache_queries ? pct(st.prefix_cache_hits / st.prefix_cache_queries) : "–";
  $("preemptions").textContent = `${st.num_preemptions || 0}`;
  $("tokens").textContent = `${st.num_prompt_tokens || 0} / ${st.num_generation_tokens || 0}`;
}

function renderPool(s) {
  const byId = new Map(s.blocks.map((b) => [b.id, b]));
  const pool = $("pool");
  pool.replaceChildren();
  for (let id = 0; id < s.num_blocks; id++) {
    const b = byId.get(id);
    const state = b ? blockState(b) : "free";
    const cls = `block ${state}${b && b.ref_count > 1 ? " shared" : ""}`;
    const title = b ? `block ${id} · ref ${b.ref_count} · ${b.num_tokens} tokens${b.hash ? " · " + b.hash : ""}`
                    : `block ${id} · free`;
    pool.append(el("div", { class: cls, title, "data-id": id, "data-state": state }));
  }
  // counted from the blocks themselves: the engine's num_free_blocks includes cached-evictable ones
  const used = s.blocks.filter((b) => b.ref_count > 0).length;
  const cached = s.blocks.length - used;
  $("n-free").textContent = s.num_blocks - used - cached;
  $("n-cached").textContent = cached;
  $("n-used").textContent = used;
  $("pool-caption").textContent = `(${s.num_blocks} blocks × ${s.block_size} tokens)`;
  const frac = s.capacity_bytes ? s.payload_bytes / s.capacity_bytes : 0;
  $("bytes-bar").style.width = pct(frac);
  $("bytes").textContent = `${humanBytes(s.payload_bytes)} payload of ${humanBytes(s.capacity_bytes)} capacity (${pct(frac)})`;
  // a hybrid model's layer types (KV-cache groups) each have a pool: the blocks above are the first group's
  const groups = s.kv_cache_groups || [];
  $("groups").textContent = groups.length > 1 ? groups.map((g) =>
    `${g.layer_type}${g.window ? " (window " + g.window + ")" : ""}, ${g.num_layers} layers: ` +
    `${humanBytes(g.payload_bytes)} of ${humanBytes(g.capacity_bytes)}, ${g.num_used_blocks}/${g.num_blocks} blocks`
  ).join(" · ") : "";
}

function renderTree(s) {
  const hashed = s.blocks.filter((b) => b.hash);
  const byHash = new Map(hashed.map((b) => [b.hash, b]));
  const children = new Map();
  const roots = [];
  for (const b of hashed) {
    if (b.parent && byHash.has(b.parent)) {
      if (!children.has(b.parent)) children.set(b.parent, []);
      children.get(b.parent).push(b);
    } else {
      roots.push(b);
    }
  }
  const tree = $("tree");
  if (!roots.length) {
    tree.replaceChildren(el("div", { class: "dim", text: "no cached blocks yet" }));
    return;
  }
  const nodeFor = (b, kids) => {
    const state = blockState(b);
    return el("span", { class: `node ${state}${kids.length > 1 ? " fork" : ""}`, "data-hash": b.hash,
                        "data-state": state, title: `block ${b.id} · ${b.hash}` },
      el("b", { text: `#${b.id}` }),
      el("code", { text: JSON.stringify(b.text !== undefined ? b.text : b.token_ids.join(" ")) }),
      el("span", { class: "ref", text: `ref ${b.ref_count}${kids.length > 1 ? ` · ${kids.length} branches` : ""}` }));
  };
  // A chain of single-child blocks stays at one indent (a radix tree's edge); only a fork indents.
  const build = (blocks) => {
    const ul = el("ul");
    for (let b of blocks.sort((x, y) => x.id - y.id)) {
      for (;;) {
        const kids = children.get(b.hash) || [];
        const li = el("li", {}, nodeFor(b, kids));
        ul.append(li);
        if (kids.length === 1) { b = kids[0]; continue; }
        if (kids.length > 1) {   // one indented group per branch, so each continuation reads on its own
          li.append(el("ul", { class: "branches" },
            ...kids.sort((x, y) => x.id - y.id).map((k) => el("li", { class: "branch" }, build([k])))));
        }
        break;
      }
    }
    return ul;
  };
  tree.replaceChildren(build(roots));
}

function renderRequests(s) {
  const body = $("requests").querySelector("tbody");
  body.replaceChildren();
  for (const r of s.requests) {
    const total = Math.max(r.num_prompt_tokens, 1);
    const cachedW = (100 * r.num_cached_tokens) / total;
    const computedW = (100 * Math.max(Math.min(r.num_computed_tokens, r.num_prompt_tokens) - r.num_cached_tokens, 0)) / total;
    const split = el("div", { class: "split", title: `${r.num_cached_tokens} cached, ${r.num_computed_tokens} computed` },
      el("div", { class: "hit", style: `width:${cachedW}%` }), el("div", { class: "computed", style: `width:${computedW}%` }));
    body.append(el("tr", { class: "request", "data-id": r.request_id },
      el("td", { text: r.request_id.slice(0, 22) }), el("td", { text: r.status }),
      el("td", { text: `${r.num_prompt_tokens}` }),
      el("td", {}, split, el("span", { class: "dim", text: ` ${r.num_cached_tokens} cached` +
        (r.num_tier_tokens ? ` (${r.num_tier_tokens} from the KV tier)` : "") })),
      el("td", { text: `${r.num_output_tokens}` }), el("td", { text: `${r.block_table.length}` }),
      el("td", { class: "acceptance", text: acceptance(r) })));
  }
  if (!s.requests.length) body.append(el("tr", {}, el("td", { class: "dim", colspan: 7, text: "idle" })));
}

// speculative decoding: guesses kept / guesses made ("-" when the request has not speculated)
function acceptance(r) {
  const drafted = r.num_drafted_tokens || 0, accepted = r.num_accepted_tokens || 0;
  return drafted ? `${accepted}/${drafted} (${Math.round((100 * accepted) / drafted)} %)` : "-";
}

function renderChart(s) {
  const st = s.stats || {};
  history.push({ t: s.time, queries: st.prefix_cache_queries || 0, hits: st.prefix_cache_hits || 0 });
  if (history.length > HISTORY) history.shift();
  const canvas = $("hit-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#e5e7eb";
  for (const y of [0, 0.5, 1]) { ctx.beginPath(); ctx.moveTo(0, h - 10 - y * (h - 20)); ctx.lineTo(w, h - 10 - y * (h - 20)); ctx.stroke(); }
  const xs = (i) => (w * i) / (HISTORY - 1);
  const ys = (v) => h - 10 - v * (h - 20);
  const line = (values, color) => {
    ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
    let started = false;
    values.forEach((v, i) => {
      if (v === null) return;
      if (!started) { ctx.moveTo(xs(i), ys(v)); started = true; } else ctx.lineTo(xs(i), ys(v));
    });
    ctx.stroke();
  };
  const interval = history.map((p, i) => {
    if (!i) return null;
    const dq = p.queries - history[i - 1].queries;
    return dq > 0 ? (p.hits - history[i - 1].hits) / dq : null;
  });
  const cumulative = history.map((p) => (p.queries ? p.hits / p.queries : null));
  line(cumulative, "#60a5fa");
  line(interval, "#10b981");
  const last = cumulative[cumulative.length - 1];
  if (last !== null) {   // the latest value as a dot, so even the first sample shows
    ctx.fillStyle = "#60a5fa"; ctx.beginPath(); ctx.arc(xs(cumulative.length - 1), ys(last), 3, 0, 7); ctx.fill();
  }
  ctx.fillStyle = "#6b7280"; ctx.font = "11px system-ui";
  ctx.fillText("100%", 2, 12); ctx.fillText("cumulative", w - 150, 12);
  ctx.fillStyle = "#10b981"; ctx.fillText("interval", w - 70, 12);
}

async function refresh() {
  try {
    const response = await fetch(STATE_URL, { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    renderSummary(s); renderPool(s); renderTree(s); renderRequests(s); renderChart(s);
    refreshes += 1;
    document.body.dataset.refreshes = `${refreshes}`;
    $("status").className = "status ok";
    $("status").textContent = `live · ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("status").className = "status err";
    $("status").textContent = `${err.message}${key ? "" : " (with an API key, open /#key=…)"}`;
  }
}

refresh();
setInterval(refresh, POLL_MS);
