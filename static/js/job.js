// The job page: draws the server-built plotly figures and follows the job live.
//
// Live: every 500 ms the page sends its cursor (one signature per part) to /jobs/<id>/live/; the
// answer names the parts that changed (usually none), and only those fragments are fetched. Charts
// keep their DOM node and are updated with Plotly.react, so zoom survives updates.
// The timeline follows the newest minutes while "follow live" is on; zooming or panning turns it
// off and fetches that window at full detail (the server downsamples wide windows).
(function () {
  "use strict";
  const U = window.Unbroken;
  const cfgEl = document.getElementById("live-config");
  if (!cfgEl || typeof Plotly === "undefined") return;
  const cfg = JSON.parse(cfgEl.textContent);
  let cursor = cfg.cursor;
  const followBox = document.getElementById("follow-live");
  const state = { follow: followBox ? followBox.checked : false, window: null, suppress: 0, timeline: null,
                  followSpan: 600000, node: new URLSearchParams(window.location.search).get("node") || "" };
  // Filters and pages of the paginated parts, kept across live refreshes.
  const partParams = { faults: new URLSearchParams(window.location.search), ranks: new URLSearchParams() };
  const PART_KEYS = { faults: ["fault_class", "layer", "rank", "page"], ranks: ["rnode", "rpage"] };

  // The mode bar keeps zoom, pan, reset and PNG download. Nothing may offer to send job data off this
  // host: plotly.js 4 shows a "Share chart..." (Plotly Cloud upload) button unless showSendToCloud is
  // false, so it is turned off, removed by name, and given no server URL to upload to.
  const PLOT_CONFIG = {
    responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false, showLink: false,
    plotlyServerURL: "", linkText: "",
    modeBarButtonsToRemove: ["select2d", "lasso2d", "sendChartToCloud", "sendDataToCloud", "editInChartStudio",
                             "toggleSpikelines", "hoverClosestCartesian", "hoverCompareCartesian"],
  };

  function readData(id) {
    const el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  function draw(div) {
    const data = readData(div.dataset.chart);
    if (!data) return;
    const config = Object.assign({}, PLOT_CONFIG, div.dataset.chart === "timeline-data" ? { scrollZoom: true } : {});
    state.suppress += 1;
    const done = Plotly.react(div, data.figure.data, fitLayout(div, data.figure.layout), config);
    Promise.resolve(done).finally(function () { state.suppress -= 1; });
    if (div.dataset.chart === "timeline-data") setupTimeline(div, data);
  }

  // The timeline's lanes keep their height whatever the legend needs: plotly pushes the top margin
  // for a legend that wraps onto more rows (more traces in view, a narrower window), and with a fixed
  // figure height that squeezes the lanes. After every draw the figure grows or shrinks by exactly
  // what the margins took, so the plot area stays ``plot_height`` pixels tall.
  function keepPlotHeight(div) {
    const t = state.timeline;
    const full = div._fullLayout;
    if (!t || t.div !== div || !full || !full._size || !t.data.plot_height) return;
    const want = Math.round(t.data.plot_height * (window.innerWidth < 700 ? 1.4 : 1));
    const height = Math.round(full._size.t + full._size.b + want);
    if (Math.abs(full._size.h - want) <= 1 || Math.abs(full.height - height) <= 1) return;
    t.height = height;
    state.suppress += 1;
    Promise.resolve(Plotly.relayout(div, { height: height })).finally(function () { state.suppress -= 1; });
  }

  // Narrow screens: legends wrap onto more lines, so give the plot more height rather than squeeze it.
  function fitLayout(div, layout) {
    const w = window.innerWidth;
    const t = state.timeline;
    if (t && t.div === div && t.height) layout = Object.assign({}, layout, { height: t.height });
    if (w >= 700) return layout;
    const out = Object.assign({}, layout);
    out.height = Math.round((layout.height || 300) * 1.4 + 140);
    out.legend = Object.assign({}, layout.legend || {}, { font: { size: 9 } });
    out.margin = Object.assign({}, layout.margin || {}, { l: Math.min((layout.margin || {}).l || 60, 96), r: 16 });
    return out;
  }

  function drawAll(root) {
    root.querySelectorAll("[data-chart]").forEach(draw);
  }

  // -- timeline ---------------------------------------------------------------------------------
  function setupTimeline(div, data) {
    const height = state.timeline && state.timeline.div === div ? state.timeline.height : null;
    state.timeline = { div: div, data: data, height: height };
    const r = data.figure.layout.xaxis.range;
    state.window = [r[0], r[1]];
    if (!div.dataset.bound) {
      div.dataset.bound = "1";
      div.on("plotly_relayout", onRelayout);
      div.on("plotly_afterplot", function () { keepPlotHeight(div); });
      div.on("plotly_click", onTimelineClick);
    }
    keepPlotHeight(div);
  }

  let zoomTimer = null;
  function onRelayout(ev) {
    if (state.suppress > 0 || !ev) return;
    let a = ev["xaxis.range[0]"], b = ev["xaxis.range[1]"];
    if (ev["xaxis.range"]) { a = ev["xaxis.range"][0]; b = ev["xaxis.range"][1]; }
    if (ev["xaxis.autorange"]) {
      setFollow(false);
      state.window = null;
      refreshPart("timeline");
      return;
    }
    if (a === undefined || b === undefined) return;
    const t0 = toMs(a), t1 = toMs(b);
    state.window = [t0, t1];
    // A window that still reaches the present keeps following; one in the past stops.
    if (t1 < U.serverNow() - 3000) setFollow(false);
    else state.followSpan = Math.max(10000, t1 - t0);
    clearTimeout(zoomTimer);
    zoomTimer = setTimeout(function () { refreshPart("timeline"); }, 250);
  }

  function toMs(v) {
    if (typeof v === "number") return v;
    // plotly gives "YYYY-MM-DD HH:MM:SS.sss" in UTC for date axes
    return Date.parse(String(v).replace(" ", "T") + (String(v).endsWith("Z") ? "" : "Z"));
  }

  function setFollow(on) {
    state.follow = on;
    if (followBox) followBox.checked = on;
  }

  // While following: extend the open bars to now and keep the newest minutes in view. The figure
  // is re-drawn with Plotly.react (a restyle of bar lengths would re-type the date axis as linear).
  function followTick() {
    const t = state.timeline;
    if (!t || !state.follow || !t.data.active) return;
    const now = U.serverNow();
    const fig = t.data.figure;
    (t.data.open || []).forEach(function (p) {
      const tr = fig.data[p[0]];
      if (!tr || !tr.base) return;
      tr.x = tr.x.slice();
      tr.x[p[1]] = Math.max(1, now - tr.base[p[1]]);
    });
    state.window = [Math.max(t.data.start_ms - 2000, now - state.followSpan), now + 2000];
    fig.layout.xaxis.range = state.window.slice();
    fig.layout.datarevision = now;
    state.suppress += 1;
    Promise.resolve(Plotly.react(t.div, fig.data, fitLayout(t.div, fig.layout))).finally(function () { state.suppress -= 1; });
  }
  setInterval(followTick, 1000);

  if (followBox) {
    followBox.addEventListener("change", function () {
      setFollow(followBox.checked);
      if (state.follow) {
        const now = U.serverNow();
        state.window = [now - state.followSpan, now];
        refreshPart("timeline");
      }
    });
  }
  const allBtn = document.getElementById("timeline-all");
  if (allBtn) {
    allBtn.addEventListener("click", function () {
      setFollow(false);
      state.window = null;
      refreshPart("timeline");
    });
  }

  // -- parts --------------------------------------------------------------------------------------
  function partUrl(name) {
    const base = cfg.part.replace(/\/x\/$/, "/" + name + "/");
    const q = new URLSearchParams();
    if (name === "timeline") {
      q.set("follow", state.follow ? "1" : "0");
      if (state.node) q.set("node", state.node);
      if (state.window) {
        q.set("start", String(Math.round(state.window[0])));
        q.set("end", String(Math.round(state.window[1])));
      }
    } else if (PART_KEYS[name]) {
      PART_KEYS[name].forEach(function (k) {
        const v = partParams[name].get(k);
        if (v) q.set(k, v);
      });
    }
    const s = q.toString();
    return s ? base + "?" + s : base;
  }

  async function refreshPart(name) {
    const container = document.querySelector('[data-part="' + name + '"]');
    if (!container) return true;
    const r = await fetch(partUrl(name), { credentials: "same-origin", cache: "no-store" });
    if (!r.ok) return false;
    const html = await r.text();
    // Keep existing chart nodes (their zoom and hover state) and feed them the new data.
    const old = {};
    container.querySelectorAll("[data-chart]").forEach(function (div) { old[div.dataset.chart] = div; });
    const tpl = document.createElement("template");
    tpl.innerHTML = html;
    tpl.content.querySelectorAll("[data-chart]").forEach(function (placeholder) {
      const keep = old[placeholder.dataset.chart];
      if (keep) placeholder.replaceWith(keep);
    });
    container.replaceChildren(tpl.content);
    drawAll(container);
    container.querySelectorAll("[data-scroll-bottom]").forEach(function (el) { el.scrollTop = el.scrollHeight; });
    return true;
  }

  async function poll() {
    try {
      const r = await fetch(cfg.live + "?c=" + encodeURIComponent(cursor), { credentials: "same-origin", cache: "no-store" });
      const type = r.headers.get("Content-Type") || "";
      if (r.ok && type.indexOf("application/json") === 0) {
        const j = await r.json();
        U.clockOffset = j.server_ms - Date.now();
        const results = await Promise.all(j.changed.map(refreshPart));
        if (results.every(Boolean)) cursor = j.cursor;
        U.markLive(true);
      } else {
        U.markLive(false);
      }
    } catch (err) {
      U.markLive(false);
    }
    setTimeout(poll, cfg.interval_ms);
  }

  // A large job's timeline: drill down to one node's ranks (a node lane, a node link, the node field)
  // and back to every node ("" clears it).
  function showNode(node) {
    state.node = node || "";
    refreshPart("timeline");
  }
  function onTimelineClick(ev) {
    const t = state.timeline;
    const pt = ev && ev.points && ev.points[0];
    if (!t || !pt || !t.data.lane_nodes) return;
    const w = pt.data.width;
    if (Array.isArray(w) && w[pt.pointNumber] >= 1) return;  // a job-wide bar spans every lane
    const node = t.data.lane_nodes[Math.round(pt.y)];
    if (node) showNode(node);
  }

  // Filters and pages of the fault and rank tables without a reload (the same GET forms work without JS).
  document.addEventListener("submit", function (e) {
    const form = e.target;
    if (!(form instanceof HTMLFormElement)) return;
    if (form.hasAttribute("data-timeline-node-form")) {
      e.preventDefault();
      showNode(String(new FormData(form).get("node") || "").trim());
      return;
    }
    const name = form.dataset.partFilter;
    if (!PART_KEYS[name]) return;
    e.preventDefault();
    partParams[name] = new URLSearchParams(new FormData(form));
    partParams[name].delete(name === "faults" ? "page" : "rpage");
    refreshPart(name);
  });
  document.addEventListener("click", function (e) {
    const b = e.target.closest && e.target.closest("[data-timeline-node]");
    if (b) {
      e.preventDefault();
      showNode(b.dataset.timelineNode);
      const tl = document.getElementById("part-timeline");
      if (tl && tl.scrollIntoView) tl.scrollIntoView({ block: "nearest" });
      return;
    }
    const a = e.target.closest && e.target.closest("[data-part-pager] a");
    if (!a) return;
    const name = a.closest("[data-part-pager]").dataset.partPager;
    if (!PART_KEYS[name]) return;
    e.preventDefault();
    partParams[name] = new URL(a.href).searchParams;
    refreshPart(name);
  });

  let started = false;
  function start() {
    if (started) return;
    started = true;
    drawAll(document);
    document.querySelectorAll("[data-scroll-bottom]").forEach(function (el) { el.scrollTop = el.scrollHeight; });
    setTimeout(poll, cfg.interval_ms);
  }
  // Deferred scripts run once the document is parsed (readyState "interactive").
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
