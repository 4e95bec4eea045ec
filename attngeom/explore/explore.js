// attngeom explore: the head grid and, for a clicked head, its panels.
// Data arrive as scripts calling attngeomExplore.index(...) (at load) and
// attngeomExplore.head(...) (injected when a head is clicked): pages opened from disk
// cannot fetch() files.
(function () {
  "use strict";

  var VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  var VOTES = ["diagonal", "sink", "other"];
  var STATS = [
    { key: "regime", label: "regime", needs: "regime" },
    { key: "f_score", label: "mean F at N", needs: "f_score" },
    { key: "lambda", label: "lambda = ||v0|| / C", needs: "lambda" },
    { key: "delta_nll", label: "mean delta NLL (ablation)", needs: "delta_nll" },
    { key: "vote_diagonal", label: "Diagonal vote fraction", needs: "vote_diagonal" },
    { key: "vote_sink", label: "Sink vote fraction", needs: "vote_sink" },
  ];

  var state = { index: null, run: null, stat: null, n: 0, seq: 0, query: -1, heads: {}, current: null, decoded: {},
                plotly: "absent" };

  window.attngeomExplore = {
    index: function (payload) { state.index = payload; },
    // A head's payload comes gzipped in base64; it is inflated as it arrives, then drawn.
    head: function (runId, layer, head, packed) {
      var k = key(runId, layer, head);
      state.heads[k] = "inflating";
      inflate(packed).then(function (payload) {
        state.heads[k] = payload;
        if (state.run && state.run.id === runId && isCurrent(state.run, layer, head)) renderHead();
      }, function (error) {
        delete state.heads[k];
        $("head-hint").hidden = false;
        $("head-hint").textContent = "Could not read the data of layer " + layer + ", head " + head + ": " + error;
      });
    },
  };

  function key(runId, layer, head) { return runId + "/" + layer + "/" + head; }
  function $(id) { return document.getElementById(id); }
  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "n/a";
    return Number(x).toPrecision(digits || 3);
  }
  function pct(x) { return x === null || x === undefined ? "n/a" : (100 * x).toFixed(1) + "%"; }
  function option(select, value, label, disabled) {
    var o = el("option", { value: String(value) }, label);
    o.disabled = !!disabled;
    select.appendChild(o);
  }

  function bytes(b64) {
    var bin = atob(b64), out = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function inflate(b64) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject("this browser lacks DecompressionStream (Chrome 80, Firefox 113, Safari 16.4 have it)");
    }
    var stream = new Blob([bytes(b64)]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).text().then(JSON.parse);
  }

  // Little-endian float32, NaN (undefined) as null.
  function float32(b64) {
    return Array.from(new Float32Array(bytes(b64).buffer), function (v) { return Number.isNaN(v) ? null : v; });
  }

  // Little-endian IEEE half floats (attention weights), as numbers.
  function float16(b64) {
    var raw = bytes(b64), out = new Float64Array(raw.length >> 1);
    for (var i = 0; i < out.length; i++) {
      var h = raw[2 * i] | (raw[2 * i + 1] << 8), sign = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
      out[i] = sign * (e === 0 ? m * Math.pow(2, -24) : e === 31 ? (m ? NaN : Infinity) : (1 + m / 1024) * Math.pow(2, e - 15));
    }
    return out;
  }

  // Points on a uint16 grid: lo + q * step per axis, 65535 for a point not drawn.
  function plane(p) {
    var raw = bytes(p.q), q = new Uint16Array(raw.buffer), n = q.length >> 1;
    var x = new Float64Array(n), y = new Float64Array(n);
    for (var k = 0; k < n; k++) {
      x[k] = q[2 * k] === 65535 ? NaN : p.lo[0] + q[2 * k] * p.step;
      y[k] = q[2 * k + 1] === 65535 ? NaN : p.lo[1] + q[2 * k + 1] * p.step;
    }
    return { x: x, y: y };
  }

  // Key positions: uint16, or uint32 for a context of more than 65,536 keys.
  function positions(b64, length) {
    var raw = bytes(b64);
    return Array.from(length > 65536 ? new Uint32Array(raw.buffer) : new Uint16Array(raw.buffer));
  }

  // One N of an instance: its numbers, and its mask of misplaced keys (top-N keys outside
  // r_min, other keys inside r_max; packed 8 keys a byte, key k at bit k % 8 of byte k >> 3,
  // one mask of ceil(K / 8) bytes per N after the other).
  function perN(inst, arrays, run, g) {
    var p = arrays.perN, width = (arrays.x.length + 7) >> 3;
    return {
      n: run.n_grid[g], s: [p.s[2 * g], p.s[2 * g + 1]], r_min: p.r_min[g], r_max: p.r_max[g],
      precision: p.precision[g], recall: p.recall[g], source: inst.per_n.exact[g] ? inst.source : "distances",
      misplaced: arrays.misplaced.subarray(g * width, (g + 1) * width),
    };
  }
  function has(mask, k) { return (mask[k >> 3] >> (k & 7)) & 1; }

  // ---- start ----

  document.addEventListener("DOMContentLoaded", function () {
    if (!state.index) {
      $("notes").appendChild(el("li", { class: "error" }, "data/index.js did not load"));
      return;
    }
    $("store").textContent = "Store: " + state.index.store;
    var runSelect = $("run-select");
    state.index.runs.forEach(function (run, i) {
      option(runSelect, i, run.id + " (" + run.model + " · " + run.dataset + " · L=" + run.length + " · " + run.dtype + ")");
    });
    runSelect.addEventListener("change", function () { selectRun(Number(runSelect.value)); });
    $("stat-select").addEventListener("change", function () { state.stat = this.value; paintGrid(); });
    $("n-select").addEventListener("change", function () {
      state.n = Number(this.value);
      if (state.stat === "f_score") paintGrid();
      renderHead();
    });
    $("seq-select").addEventListener("change", function () { state.seq = Number(this.value); renderHead(); });
    $("query-select").addEventListener("change", function () { state.query = Number(this.value); renderHead(); });
    selectRun(0);
    document.body.setAttribute("data-ready", "1");
    loadPlotly();
  });

  // plotly.js (4.7 MB) is parsed after the grid is up, not before: the page shows its grid
  // at once, and a head clicked meanwhile renders when plotly arrives.
  function loadPlotly() {
    state.plotly = "loading";
    var script = el("script", { src: "plotly.min.js" });
    script.onload = function () { state.plotly = "ready"; renderHead(); };
    script.onerror = function () {
      $("notes").appendChild(el("li", { class: "error" }, "plotly.min.js did not load: no plots"));
    };
    document.head.appendChild(script);
  }

  function selectRun(i) {
    var run = state.index.runs[i];
    state.run = run;
    state.current = null;
    $("head-body").hidden = true;
    $("head-hint").hidden = false;

    var statSelect = $("stat-select");
    statSelect.innerHTML = "";
    // The field's scores the run has (analysis/head_scores, detect) colour the grid too.
    var stats = STATS.concat(Object.keys(run.field.labels).map(function (name) {
      return { key: name, label: run.field.labels[name], needs: name };
    }));
    var available = stats.filter(function (s) { return run.stats[s.needs] !== undefined; });
    stats.forEach(function (s) {
      var has = run.stats[s.needs] !== undefined;
      option(statSelect, s.key, s.label + (has ? "" : " (not in this store)"), !has);
    });
    state.stat = available.length ? available[0].key : null;
    if (state.stat) statSelect.value = state.stat;

    var nSelect = $("n-select");
    nSelect.innerHTML = "";
    run.n_grid.forEach(function (n, g) { option(nSelect, g, String(n)); });
    state.n = Math.min(run.n_grid.length - 1, Math.max(0, run.n_grid.indexOf(8)));
    if (run.n_grid.indexOf(8) < 0) state.n = Math.floor((run.n_grid.length - 1) / 2);
    nSelect.value = String(state.n);

    var seqSelect = $("seq-select");
    seqSelect.innerHTML = "";
    run.sequences.forEach(function (s, b) { option(seqSelect, b, "sequence " + s); });
    state.seq = 0;

    // The final query (analysis/topn), then each query whose rows the run kept (--queries).
    var querySelect = $("query-select");
    querySelect.innerHTML = "";
    option(querySelect, -1, "final (q = " + (run.length - 1) + ")");
    run.query_pos.forEach(function (q, i) { option(querySelect, i, "q = " + q); });
    querySelect.disabled = run.query_pos.length === 0;
    state.query = -1;
    querySelect.value = "-1";

    var notes = $("notes");
    notes.innerHTML = "";
    run.notes.concat(["tokens: " + run.tokens_note]).forEach(function (n) { notes.appendChild(el("li", {}, n)); });
    buildGrid();
  }

  // ---- the head grid ----

  function buildGrid() {
    var run = state.run, grid = $("head-grid");
    grid.innerHTML = "";
    grid.style.gridTemplateColumns = "2.5em repeat(" + run.heads + ", 16px)";
    $("grid-title").textContent = "Heads of " + run.id + ": " + run.layers + " layers × " + run.heads +
      " heads (" + run.kv_heads + " kv heads)";
    grid.appendChild(el("div", { class: "axis top" }, "L\\H"));
    for (var h = 0; h < run.heads; h++) grid.appendChild(el("div", { class: "axis top" }, String(h)));
    for (var l = 0; l < run.layers; l++) {
      grid.appendChild(el("div", { class: "axis" }, String(l)));
      for (h = 0; h < run.heads; h++) {
        var cell = el("div", { class: "cell", "data-layer": String(l), "data-head": String(h), role: "gridcell" });
        cell.addEventListener("click", onCellClick);
        grid.appendChild(cell);
      }
    }
    paintGrid();
  }

  function onCellClick(event) {
    var cell = event.currentTarget;
    selectHead(Number(cell.getAttribute("data-layer")), Number(cell.getAttribute("data-head")));
  }

  function statValue(l, h) {
    var s = state.run.stats, stat = state.stat;
    if (!stat || s[stat] === undefined) return null;
    if (stat === "f_score") return s.f_score[l][h][state.n];
    return s[stat][l][h];
  }

  function viridis(t) {
    var x = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1), i = Math.min(Math.floor(x), VIRIDIS.length - 2);
    var f = x - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + f * (b[k] - a[k])); }).join(",") + ")";
  }

  function paintGrid() {
    var run = state.run, legend = $("legend"), cells = document.querySelectorAll("#head-grid .cell");
    legend.innerHTML = "";
    var lo = Infinity, hi = -Infinity;
    if (state.stat && state.stat !== "regime") {
      for (var l = 0; l < run.layers; l++) for (var h = 0; h < run.heads; h++) {
        var v = statValue(l, h);
        if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
      }
    }
    cells.forEach(function (cell) {
      var l = Number(cell.getAttribute("data-layer")), h = Number(cell.getAttribute("data-head"));
      var v = statValue(l, h), color = "#ddd";
      if (state.stat === "regime" && v !== null) color = state.index.palette.regime[v] || "#999";
      else if (v !== null) color = viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5);
      cell.style.background = color;
      cell.title = "layer " + l + ", head " + h + " (kv " + run.head_kv[h] + ")" +
        (state.stat ? ": " + (typeof v === "number" ? fmt(v) : v === null ? "n/a" : v) : "");
    });
    if (!state.stat) {
      legend.textContent = "No statistic to colour by: run `attngeom analyze`.";
    } else if (state.stat === "regime") {
      Object.keys(state.index.palette.regime).forEach(function (name) {
        var item = el("span");
        var sw = el("span", { class: "swatch" });
        sw.style.background = state.index.palette.regime[name];
        item.appendChild(sw);
        item.appendChild(document.createTextNode(name));
        legend.appendChild(item);
      });
    } else {
      var label = state.run.field.labels[state.stat] ||
        STATS.filter(function (s) { return s.key === state.stat; })[0].label;
      if (state.stat === "f_score") label = "mean F at N = " + run.n_grid[state.n];
      var bar = el("span", { class: "bar" });
      bar.style.background = "linear-gradient(to right," + [0, 0.25, 0.5, 0.75, 1].map(viridis).join(",") + ")";
      legend.appendChild(el("span", {}, label + ": " + fmt(lo) ));
      legend.appendChild(bar);
      legend.appendChild(el("span", {}, fmt(hi)));
    }
  }

  // ---- one head ----

  function selectHead(layer, head) {
    var run = state.run;
    state.current = { layer: layer, head: head };
    document.querySelectorAll("#head-grid .cell.selected").forEach(function (c) { c.classList.remove("selected"); });
    var cell = document.querySelector('#head-grid .cell[data-layer="' + layer + '"][data-head="' + head + '"]');
    if (cell) cell.classList.add("selected");
    var k = key(run.id, layer, head);
    if (state.heads[k]) { renderHead(); return; }
    var script = el("script", { src: "data/" + encodeURIComponent(run.id) + "/head_" + layer + "_" + head + ".js" });
    script.onload = function () { if (isCurrent(run, layer, head)) renderHead(); };
    script.onerror = function () {
      $("head-hint").hidden = false;
      $("head-hint").textContent = "Could not load the data of layer " + layer + ", head " + head + ".";
    };
    document.head.appendChild(script);
  }

  function isCurrent(run, layer, head) {
    return state.run === run && state.current && state.current.layer === layer && state.current.head === head;
  }

  function renderHead() {
    var run = state.run, cur = state.current;
    if (!cur) return;
    var data = state.heads[key(run.id, cur.layer, cur.head)];
    if (!data || data === "inflating" || state.plotly !== "ready") return;
    var atQuery = state.query >= 0 && data.by_query && data.by_query.length > state.query;
    var inst = atQuery ? data.by_query[state.query][state.seq] : data.instances[state.seq];
    var q = atQuery ? run.query_pos[state.query] : run.length - 1;
    var g = state.n, n = run.n_grid[g];
    var dk = run.id + "/" + cur.layer + "/" + cur.head + "/" + state.seq + "/" + q;
    if (!state.decoded[dk]) {
      var xy = plane(inst.xy);
      state.decoded = {};  // one instance decoded at a time: memory stays flat however many heads are viewed
      state.decoded[dk] = { attn: float16(inst.attn), x: xy.x, y: xy.y, order: positions(inst.order, run.length),
                            misplaced: bytes(inst.per_n.misplaced), perN: {}, curves: null };
      ["s", "r_min", "r_max", "precision", "recall"].forEach(function (name) {
        state.decoded[dk].perN[name] = float32(inst.per_n[name]);
      });
      if (inst.curves) {
        state.decoded[dk].curves = {};
        Object.keys(inst.curves).forEach(function (name) { state.decoded[dk].curves[name] = float32(inst.curves[name]); });
      }
    }
    var arrays = state.decoded[dk];
    $("head-hint").hidden = true;
    $("head-body").hidden = false;
    document.querySelectorAll(".n-label").forEach(function (s) { s.textContent = String(n); });
    $("head-title").textContent = "Layer " + cur.layer + ", head " + cur.head +
      (data.regime ? " — " + data.regime.regime : "") + " — sequence " + inst.seq + " — query " + q;
    var kv = "reads kv head " + data.kv_head;
    if (run.kv_heads < run.heads) kv += " (GQA: shared with head" + (data.shares_kv.length === 1 ? " " : "s ") + data.shares_kv.join(", ") + ")";
    $("head-meta").textContent = kv + " · " + (data.window ? "sliding window " + data.window : "full causal attention") +
      " · head_dim " + run.head_dim + " · L = " + run.length;
    renderGeometry(run, inst, arrays, g);
    renderCurves(run, arrays, g);
    renderRegime(data, inst);
    renderField(run, cur.layer, cur.head);
    renderTokens(run, inst, arrays, g);
    $("head-view").setAttribute("data-rendered", cur.layer + "_" + cur.head);
  }

  function renderGeometry(run, inst, arrays, g) {
    var per = perN(inst, arrays, run, g), n = per.n;
    var top = new Set(arrays.order.slice(0, n)), misplaced = per.misplaced;
    var groups = { rest: [], selected: [], strays: [], intruders: [] };
    for (var j = 0; j < arrays.x.length; j++) {
      if (Number.isNaN(arrays.x[j])) continue;
      var group = top.has(j) ? (has(misplaced, j) ? "strays" : "selected") : (has(misplaced, j) ? "intruders" : "rest");
      groups[group].push(j);
    }
    var tokens = run.tokens[state.seq];
    function trace(idx, name, marker) {
      return {
        type: "scatter", mode: "markers", name: name + " (" + idx.length + ")", marker: marker,
        x: idx.map(function (j) { return arrays.x[j]; }), y: idx.map(function (j) { return arrays.y[j]; }),
        text: idx.map(function (j) { return "pos " + j + " " + JSON.stringify(tokens[j]) + "<br>α = " + fmt(arrays.attn[j]); }),
        hoverinfo: "text",
      };
    }
    var traces = [
      trace(groups.rest, "not selected, outside r_max", { color: "#9a9a9a", size: 5, opacity: 0.6 }),
      trace(groups.intruders, "not selected, inside r_max", { color: "#d62728", size: 9, symbol: "x" }),
      trace(groups.selected, "top-N, inside r_min", { color: "#ff7f0e", size: 12, symbol: "star", line: { color: "#7a3a00", width: 0.5 } }),
      trace(groups.strays, "top-N, outside r_min", { color: "#ffffff", size: 12, symbol: "star", line: { color: "#ff7f0e", width: 1.5 } }),
    ];
    if (!Number.isNaN(arrays.x[0])) {  // position 0 attendable: this instance has a sink
      traces.push({ type: "scatter", mode: "markers+text", name: "sink y_0", x: [arrays.x[0]], y: [arrays.y[0]],
        text: ["sink"], textposition: "top right", marker: { color: "#000", size: 10, symbol: "square-open", line: { width: 2 } },
        hoverinfo: "skip" });
    }
    var shapes = [];
    if (per.s && per.s[0] !== null) {
      traces.push({ type: "scatter", mode: "markers+text", name: "s_N", x: [per.s[0]], y: [per.s[1]], text: ["s_N"],
        textposition: "bottom right", marker: { color: "#000", size: 12, symbol: "diamond" }, hoverinfo: "skip" });
      // Different dashes: the two circles coincide when r_min = r_max.
      [["r_max", per.r_max, "#d62728", "dash"], ["r_min", per.r_min, "#2ca02c", "dot"]].forEach(function (c) {
        if (c[1] === null || !Number.isFinite(c[1])) return;
        shapes.push({ type: "circle", xref: "x", yref: "y", x0: per.s[0] - c[1], x1: per.s[0] + c[1],
          y0: per.s[1] - c[1], y1: per.s[1] + c[1], line: { color: c[2], dash: c[3], width: 1.5 } });
      });
    }
    var ex = inst.explained;
    var layout = {
      margin: { l: 50, r: 10, t: 10, b: 40 }, shapes: shapes, showlegend: true,
      legend: { orientation: "h", y: -0.2, font: { size: 10 } }, hovermode: "closest",
      xaxis: { title: { text: "PC1 (" + pct(ex[0]) + " of the variance of the y_i)" }, zeroline: false },
      yaxis: { title: { text: "PC2 (" + pct(ex[1]) + ")" }, scaleanchor: "x", scaleratio: 1, zeroline: false },
    };
    Plotly.react("panel-geometry", traces, layout, { displaylogo: false, responsive: true });

    var f = (per.precision + per.recall) > 0 ? 2 * per.precision * per.recall / (per.precision + per.recall) : 0;
    var rows = [
      ["N", n], ["precision P(r_max, N)", fmt(per.precision)], ["recall R(r_min, N)", fmt(per.recall)],
      ["F", per.precision === null ? "n/a" : fmt(f)], ["r_min", fmt(per.r_min)], ["r_max", fmt(per.r_max)],
      ["unselected inside r_max", groups.intruders.length], ["selected outside r_min", groups.strays.length],
    ];
    var box = $("geometry-numbers");
    box.innerHTML = "";
    var table = el("table");
    rows.forEach(function (r) {
      var tr = el("tr");
      tr.appendChild(el("td", {}, r[0]));
      tr.appendChild(el("td", {}, String(r[1])));
      table.appendChild(tr);
    });
    box.appendChild(table);
    box.appendChild(el("p", { class: "caption" }, per.precision === null ? "N is not valid here (N ≥ |K|)." :
      "P and R from " + (per.source === "distances" ? "this picture's exact distances (no analysis)" : "the store's " + per.source) +
      "; distances in full dimension " + run.head_dim + "."));
  }

  function renderCurves(run, arrays, g) {
    var div = $("panel-curves");
    if (!arrays.curves) {
      Plotly.purge(div);
      div.innerHTML = "";
      div.appendChild(el("p", { class: "note" }, "No analysis of this sequence in the store: run `attngeom analyze`."));
      return;
    }
    if (div.firstChild && div.firstChild.className === "note") div.innerHTML = "";
    var c = arrays.curves, x = run.n_grid;
    function line(name, y, color, dash, width) {
      return { type: "scatter", mode: "lines+markers", name: name, x: x, y: y,
        line: { color: color, dash: dash || "solid", width: width || 2 }, marker: { size: dash ? 3 : 5 } };
    }
    var traces = [
      line("P", c.precision, "#d62728"), line("R", c.recall, "#2ca02c"), line("F", c.f_score, "#1f77b4"),
      line("P random", c.random_precision, "#d62728", "dash", 1), line("R random", c.random_recall, "#2ca02c", "dash", 1),
      line("F random", c.random_f_score, "#1f77b4", "dash", 1),
      line("P bound", c.precision_bound, "#d62728", "dot", 1), line("R bound", c.recall_bound, "#2ca02c", "dot", 1),
      line("P bound q95", c.precision_bound_q95, "#d62728", "dashdot", 1),
      line("R bound q95", c.recall_bound_q95, "#2ca02c", "dashdot", 1),
    ];
    var layout = {
      margin: { l: 45, r: 10, t: 10, b: 40 }, legend: { font: { size: 10 } },
      xaxis: { type: "log", title: { text: "N" }, tickvals: x, ticktext: x.map(String) },
      yaxis: { range: [0, 1.05], title: { text: "score" } },
      shapes: [{ type: "line", xref: "x", yref: "paper", x0: x[g], x1: x[g], y0: 0, y1: 1, line: { color: "#888", dash: "dot" } }],
    };
    Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
  }

  function voteBar(fractions) {
    var bar = el("div", { class: "votebar" });
    VOTES.forEach(function (v, i) {
      var part = el("span", { title: v + " " + pct(fractions[i]) });
      part.style.width = (100 * fractions[i]) + "%";
      part.style.background = state.index.palette.vote[v];
      bar.appendChild(part);
    });
    return bar;
  }

  function renderRegime(data, inst) {
    var box = $("panel-regime");
    box.innerHTML = "";
    if (!data.regime) {
      box.appendChild(el("p", { class: "note" }, "No analysis/heads in the store: run `attngeom analyze`."));
      return;
    }
    var r = data.regime;
    box.appendChild(el("p", {}, "Regime: " + r.regime));
    box.appendChild(el("p", { class: "caption" }, "Each query i ≥ 1 votes for its source j* = argmax_j A_ij ||v_j||: " +
      "Diagonal (j* = i), Sink (j* = 0) or Other. A sequence takes the plurality of its queries' votes, the head " +
      "the plurality of its sequences' labels (an exact tie is Other): Diagonal → Retriever, Sink → Mixer, Other → Reset."));
    var table = el("table");
    var head = el("tr");
    ["", "Diagonal", "Sink", "Other"].forEach(function (t) { head.appendChild(el("td", {}, t)); });
    table.appendChild(head);
    function row(label, cells) {
      var tr = el("tr");
      tr.appendChild(el("td", {}, label));
      cells.forEach(function (c) { tr.appendChild(el("td", {}, c)); });
      table.appendChild(tr);
    }
    row("vote fraction, all sequences", VOTES.map(function (v) { return pct(r["vote_" + v]); }));
    row("sequences labelled", VOTES.map(function (v) { return String(r["sequences_" + v]); }));
    var seqFractions = null;
    if (inst.votes) {
      var total = inst.votes.reduce(function (a, b) { return a + b; }, 0) || 1;
      seqFractions = inst.votes.map(function (c) { return c / total; });
      row("queries, sequence " + inst.seq, inst.votes.map(String));
    }
    box.appendChild(table);
    box.appendChild(el("p", { class: "caption" }, "Vote fractions, all sequences:"));
    box.appendChild(voteBar(VOTES.map(function (v) { return r["vote_" + v]; })));
    if (seqFractions) {
      box.appendChild(el("p", { class: "caption" }, "This sequence:"));
      box.appendChild(voteBar(seqFractions));
    }
  }

  // The head's field scores and the classes they put it in (docs/method.md#field-classes).
  function renderField(run, layer, head) {
    var box = $("panel-field"), field = run.field;
    box.innerHTML = "";
    var names = Object.keys(field.labels);
    if (names.length) {
      var table = el("table");
      var top = el("tr");
      ["score", "value", "class", "rule", ""].forEach(function (t) { top.appendChild(el("td", {}, t)); });
      table.appendChild(top);
      names.forEach(function (name) {
        var v = field.scores[name][layer][head];
        var criteria = field.criteria.filter(function (c) { return c.score === name; });
        var tr = el("tr");
        tr.appendChild(el("td", {}, field.labels[name]));
        tr.appendChild(el("td", {}, fmt(v)));
        if (criteria.length) {
          var c = criteria[0];
          var passes = v !== null && (c.above ? v > c.threshold : v < c.threshold);
          tr.appendChild(el("td", {}, c.name));
          tr.appendChild(el("td", { title: c.source }, c.rule));
          tr.appendChild(el("td", { class: passes ? "pass" : "" }, v === null ? "n/a" : passes ? "yes" : "no"));
        }
        table.appendChild(tr);
      });
      box.appendChild(table);
      box.appendChild(el("p", { class: "caption" }, "The field's scores of this head, averaged over the run's " +
        "sequences (text) or over detect's probes; a class is a threshold on one score (hover a rule for its source)."));
    }
    field.missing.forEach(function (n) { box.appendChild(el("p", { class: "note" }, n)); });
  }

  function renderTokens(run, inst, arrays, g) {
    var box = $("panel-tokens"), tokens = run.tokens[state.seq], ids = run.token_ids[state.seq];
    var n = run.n_grid[g], attn = arrays.attn;
    // Keys outside K (a sliding window) have no point in the picture (NaN) and take no part;
    // neither do the keys after the query, which the picture of an earlier query lacks.
    var attendable = function (j) { return j < arrays.x.length && !Number.isNaN(arrays.x[j]); };
    var top = new Set(arrays.order.slice(0, n).filter(attendable)), hasSink = attendable(0);
    var peak = 0;
    for (var j = 1; j < attn.length; j++) peak = Math.max(peak, attn[j]);
    var frag = document.createDocumentFragment();
    if (hasSink) frag.appendChild(el("span", { class: "sink-label" }, "sink α0 = " + fmt(attn[0])));
    for (j = 0; j < tokens.length; j++) {
      var cls = "tok" + (top.has(j) ? " top" : "") + (j === 0 && hasSink ? " sink" : "") + (attendable(j) ? "" : " out");
      var after = j >= attn.length;
      var span = el("span", { class: cls, title: "pos " + j + " · id " + ids[j] + (after ? " · after the query" :
        " · α = " + fmt(attn[j], 4) + (attendable(j) ? "" : " · outside the window")) }, tokens[j]);
      if (j > 0 && !after && peak > 0) span.style.background = "rgba(214, 39, 40, " + Math.min(1, attn[j] / peak).toFixed(3) + ")";
      frag.appendChild(span);
    }
    box.innerHTML = "";
    box.appendChild(frag);
  }
})();
