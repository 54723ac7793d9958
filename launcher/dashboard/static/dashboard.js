// fractus-pod dashboard: polls /api/data and draws it with uPlot (vendored, see
// uPlot.LICENSE). The server downsamples; this page only draws what it gets.
"use strict";

const POLL_MS = 2000;
const CURVES = ["ema_tf", "lb", "tok_s"];
const GPU_COLORS = ["#1f77b4", "#e377c2", "#8c564b", "#bcbd22", "#17a2b8", "#6f42c1",
                    "#20c997", "#fd7e14"];
const STAGE_FILLS = ["rgba(66,133,244,0.07)", "rgba(251,188,5,0.10)",
                     "rgba(52,168,83,0.08)", "rgba(234,67,53,0.07)", "rgba(120,120,120,0.08)"];

const state = { version: null, data: null, charts: {}, lastRender: 0, xMode: "tokens" };
window.dashboard = state;          // for people poking in the console, and for the tests

function chartWidth(el) { return Math.max(300, el.clientWidth - 16); }

// The x axis (launcher/dashboard/xaxis.py): the pod's tokens trained, or the clock with
// idle gaps cut; `knots` ([x, ts] pairs) give the clock time of an x.
function clockAt(x) {
  const k = state.data.x.knots;
  let i = 1;
  while (i < k.length - 1 && k[i][0] < x) i++;
  const [x0, t0] = k[i - 1], [x1, t1] = k[i];
  return t0 + (x1 === x0 ? 0 : (x - x0) * (t1 - t0) / (x1 - x0));
}
function tokens(n) {
  const a = Math.abs(n);
  return a >= 1e9 ? `${(n / 1e9).toFixed(2)}G` : a >= 1e6 ? `${(n / 1e6).toFixed(2)}M`
       : a >= 1e3 ? `${(n / 1e3).toFixed(1)}k` : `${Math.round(n)}`;
}
function xLabel(x) {
  return state.data.x.mode === "time" ? clock(new Date(clockAt(x) * 1000)) : tokens(x);
}
function idle(seconds) {
  const s = Math.floor(seconds);
  return s < 7200 ? `idle ${Math.floor(s / 60)}m`
       : `idle ${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

// Stage windows behind the curves (their labels at the bottom, clear of the legend), run
// starts and idle gaps, then every marker as a vertical line.
function timelinePlugin() {
  return {
    hooks: {
      drawClear: [u => {
        const d = state.data; if (!d) return;
        const ctx = u.ctx, top = u.bbox.top, h = u.bbox.height, px = devicePixelRatio;
        ctx.save();
        ctx.font = `${11 * px}px system-ui, sans-serif`;
        for (const w of d.stages) {
          const x0 = Math.max(u.bbox.left, u.valToPos(w.x0, "x", true));
          const x1 = Math.min(u.bbox.left + u.bbox.width, u.valToPos(w.x1, "x", true));
          if (x1 <= x0) continue;
          ctx.fillStyle = STAGE_FILLS[(w.stage - 1) % STAGE_FILLS.length];
          ctx.fillRect(x0, top, x1 - x0, h);
          ctx.fillStyle = "#666";
          ctx.fillText(`stage ${w.stage}`, x0 + 4 * px, top + h - 4 * px);
        }
        ctx.strokeStyle = "#999"; ctx.fillStyle = "#777"; ctx.lineWidth = px;
        d.runs.forEach((r, i) => {
          const x = Math.round(u.valToPos(r.x, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
          ctx.setLineDash([2 * px, 3 * px]);
          ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + h); ctx.stroke();
          ctx.fillText(`run ${i + 1}`, x + 3 * px, top + 12 * px);
        });
        for (const g of d.x.gaps) {
          const x = Math.round(u.valToPos(g.x, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.setLineDash([]);
          ctx.fillStyle = "rgba(0,0,0,0.06)";
          ctx.fillRect(x - 3 * px, top, 6 * px, h);
          ctx.fillStyle = "#555";
          ctx.fillText(idle(g.seconds), x + 5 * px, top + 26 * px);
        }
        ctx.restore();
      }],
      draw: [u => {
        const d = state.data; if (!d) return;
        const ctx = u.ctx, top = u.bbox.top, h = u.bbox.height;
        ctx.save();
        // Rollbacks last, on top: a stage change at the same x must not hide one.
        const order = d.markers.filter(m => m.kind !== "rollback")
          .concat(d.markers.filter(m => m.kind === "rollback"));
        for (const m of order) {
          const x = Math.round(u.valToPos(m.x, "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          const rollback = m.kind === "rollback";
          ctx.strokeStyle = d.marker_colors[m.kind] || "#000";
          ctx.lineWidth = (rollback ? 3 : 1.5) * devicePixelRatio;
          ctx.setLineDash(rollback ? [] : [5 * devicePixelRatio, 4 * devicePixelRatio]);
          ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + h); ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

function buildChart(name, gpus, aligned) {
  const el = document.getElementById(`chart-${name}`);
  const old = state.charts[name];
  if (old) old.destroy();
  const opts = {
    width: chartWidth(el), height: 220,
    scales: { x: { time: false } },
    series: [{ label: state.data.x.label, value: (u, v) => v === null ? "-" : xLabel(v) }]
      .concat(gpus.map(g => ({
      label: `gpu${g}`, stroke: GPU_COLORS[g % GPU_COLORS.length], width: 1.5,
      spanGaps: false, points: { show: false },   // null: a restart's gap
    }))),
    axes: [{ values: (u, splits) => splits.map(xLabel), label: state.data.x.label,
             labelSize: 18 }, { size: 60 }],
    plugins: [timelinePlugin()],
  };
  const chart = new uPlot(opts, aligned, el);
  chart.gpus = gpus;
  chart.xMode = state.data.x.mode;
  state.charts[name] = chart;
}

function drawCurves(d) {
  for (const name of CURVES) {
    const perGpu = d.curves[name] || {};
    const gpus = Object.keys(perGpu).map(Number).sort((a, b) => a - b);
    const tables = gpus.map(g => perGpu[String(g)]);
    // NULL_EXPAND (2): a restart's null also swallows the other GPUs' x values around
    // it, so no line is drawn across the pause.
    const aligned = tables.length ? uPlot.join(tables, tables.map(() => [0, 2])) : [[]];
    const chart = state.charts[name];
    if (chart && chart.gpus.join() === gpus.join() && chart.xMode === d.x.mode)
      chart.setData(aligned);
    else buildChart(name, gpus, aligned);
  }
}

// 24-hour clock times, as `status` prints them (toLocaleTimeString is 12-hour in en-US).
function clock(date) {
  return [date.getHours(), date.getMinutes(), date.getSeconds()]
    .map(n => String(n).padStart(2, "0")).join(":");
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v);
}
function age(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  return s < 120 ? `${s}s` : s < 7200 ? `${Math.floor(s / 60)}m`
       : `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

const COLUMNS = [
  ["GPU", r => r.gpu], ["pid", r => r.pid ? `${r.pid}${r.alive ? "" : " (dead)"}` : "-"],
  ["state", r => r.state, true], ["stage", r => fmt(r.stage)],
  ["next_token", r => r.next_token === null ? "-" : r.next_token.toLocaleString("en-US")],
  ["shard %", r => fmt(r.shard_pct, 2)], ["ema_tf", r => fmt(r.ema_tf, 4)],
  ["ema_ss", r => fmt(r.ema_ss, 4)], ["lb", r => fmt(r.lb, 3)], ["tok/s", r => fmt(r.tok_s, 0)],
  ["mem GB", r => fmt(r.mem_gb, 2)], ["ckpt age", r => age(r.checkpoint_age_s)],
  ["hub rev", r => fmt(r.hub_revision).slice(0, 12)], ["restarts", r => fmt(r.restarts)],
  ["verdict", r => fmt(r.verdict) + (r.verdict_from_last_run ? " (last run)" : ""), true],
  ["reason", r => fmt(r.reason), true],
  ["off its peers", r => Object.values(r.peers || {}).join("; ") || "-", true],
];

// The goodput panel: trained first, then each cause of lost time, one colour each.
const GOODPUT_COLORS = {
  trained: "#2e7d32", load: "#90a4ae", retrain_rollback: "#d62728", retrain_crash: "#ff7f0e",
  crash: "#8c564b", hang: "#9467bd", canary: "#17becf", node_wait: "#bcbd22",
  checkpoint_stall: "#e377c2", merge_round: "#1a237e", stopped: "#cfd8dc",
  startup: "#607d8b",
  final_probes: "#a1887f", final_push: "#78909c",
};
function gpuTime(s) { return s >= 360 ? `${(s / 3600).toFixed(2)} GPU-h` : `${Math.round(s)} GPU-s`; }

function drawGoodput(d) {
  const g = d.status.goodput;
  if (!g) return;
  const total = g.gpu_hours * 3600;
  const money = v => v === null || v === undefined ? "-" : v.toFixed(2);
  document.getElementById("goodput-line").textContent = Object.keys(g.gpus).length ?
    `goodput ${g.goodput === null ? "-" : (100 * g.goodput).toFixed(1) + "%"} of ` +
    `${g.gpu_hours.toFixed(2)} GPU-h` + (g.cost === null ? "" : `, ${money(g.cost)} paid`) +
    `; ${g.tokens_retrained.toLocaleString("en-US")} tokens trained again`
    : "no launch recorded yet";
  const parts = [["trained", "trained", g.trained_gpu_hours * 3600, null]].concat(
    Object.entries(g.lost_s).filter(([, s]) => s > 0)
      .map(([cause, s]) => [cause, g.cause_text[cause], s, g.lost_cost ? g.lost_cost[cause] : null]));
  document.getElementById("goodput-bar").replaceChildren(...parts.map(([cause, label, s]) => {
    const span = document.createElement("span");
    span.style.width = `${total > 0 ? 100 * s / total : 0}%`;
    span.style.background = GOODPUT_COLORS[cause];
    span.title = label;
    return span;
  }));
  document.querySelector("#goodput-table tbody").replaceChildren(...parts.map(
    ([cause, label, s, cost]) => {
      const tr = document.createElement("tr");
      tr.dataset.cause = cause;
      const name = text("td", label, "text");
      const swatch = document.createElement("i");
      swatch.style.background = GOODPUT_COLORS[cause];
      name.prepend(swatch);
      tr.append(name, text("td", gpuTime(s)),
                text("td", total > 0 ? `${(100 * s / total).toFixed(1)}%` : "-"),
                text("td", cause === "trained" ? money(g.cost === null ? null :
                     g.cost - Object.values(g.lost_cost).reduce((a, b) => a + b, 0)) : money(cost)));
      return tr;
    }));
}

function text(tag, content, cls) {
  const el = document.createElement(tag);
  el.textContent = content;
  if (cls) el.className = cls;
  return el;
}

function drawStatus(d) {
  const s = d.status;
  const pill = document.getElementById("pod-state");
  pill.textContent = s.pod_state; pill.className = `pill ${s.pod_state.replace(" ", "_")}`;
  document.getElementById("pod-line").textContent =
    `${s.pod_dir}  stage ${fmt(s.stage)}${s.stage_name ? ` (${s.stage_name})` : ""}` +
    (s.uptime_s ? `  uptime ${age(s.uptime_s)}` : "") + (s.reason ? `  reason: ${s.reason}` : "");
  const head = document.querySelector("#gpu-table thead");
  if (!head.children.length) {
    const tr = document.createElement("tr");
    for (const [title] of COLUMNS) tr.appendChild(text("th", title));
    head.appendChild(tr);
  }
  const body = document.querySelector("#gpu-table tbody");
  body.replaceChildren(...s.gpus.map(r => {
    const tr = document.createElement("tr");
    tr.dataset.gpu = r.gpu;
    for (const [, cell, isText] of COLUMNS) tr.appendChild(text("td", cell(r), isText ? "text" : ""));
    return tr;
  }));
  const sync = s.sync;
  document.getElementById("hub-line").textContent = sync ? `hub ${sync.hub}: last push ` +
    (sync.last_revision ? `${sync.last_revision.slice(0, 12)} (${age(sync.last_success_age_s)} ago)`
                        : "none yet") + (sync.in_flight ? "; pushing now" : "") +
    (sync.last_error ? `; last error: ${sync.last_error}` : "") : "";
  const c = s.canary;
  document.getElementById("canary-line").textContent = c ?
    `last canary: stage ${fmt(c.from_stage)} -> ${fmt(c.to_stage)}: ${c.status}: ${fmt(c.reason)}` : "";
  document.getElementById("merge-line").textContent = s.merge_rounds ? s.merge_rounds.line : "";
}

function drawMarkers(d) {
  const list = document.getElementById("markers");
  list.replaceChildren(...d.markers.slice().reverse().map(m => {
    const li = document.createElement("li");
    li.dataset.kind = m.kind;
    const when = clock(new Date(m.ts * 1000));
    const b = text("b", m.kind);
    b.style.color = d.marker_colors[m.kind];
    li.append(text("span", `${when} `), b, text("span", m.label));
    return li;
  }));
  const legend = document.getElementById("legend-markers");
  if (!legend.children.length) {
    for (const [kind, color] of Object.entries(d.marker_colors)) {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = color;
      span.append(swatch, kind.replace("_", " "));
      legend.appendChild(span);
    }
  }
}

async function poll() {
  const points = Math.min(4000, Math.max(200, window.innerWidth));
  const mode = state.xMode;
  const url = `/api/data?points=${points}&x=${mode}` +
    (state.version ? `&version=${state.version}` : "");
  try {
    const res = await fetch(url, { cache: "no-store" });
    const d = await res.json();
    if (!d.unchanged && mode === state.xMode) {    // (an answer for the old axis: dropped)
      state.data = d; state.version = d.version;
      drawCurves(d); drawStatus(d); drawMarkers(d); drawGoodput(d);
      state.lastRender = Date.now();
      if (state.readyMs === undefined) state.readyMs = performance.now();  // page ready
    }
    document.getElementById("updated").textContent =
      `updated ${clock(new Date())}`;
  } catch (err) {
    document.getElementById("updated").textContent = `dashboard unreachable: ${err}`;
  }
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, POLL_MS);
}

// The x axis selector: a new choice asks for everything again, at once.
document.getElementById("x-mode").addEventListener("change", ev => {
  state.xMode = ev.target.value;
  state.version = null;
  clearTimeout(state.timer);
  poll();
});

window.addEventListener("resize", () => {
  for (const [name, chart] of Object.entries(state.charts)) {
    chart.setSize({ width: chartWidth(document.getElementById(`chart-${name}`)), height: 220 });
  }
});
poll();
