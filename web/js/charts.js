// The dashboard's thin layer over uPlot (loaded as the global `uPlot`) and the heatmap canvas.
//
// The Rust side owns the data and the state (zoom window, selected step, what to fetch); this
// file only draws. Each call takes a JSON spec, so the boundary is one string and a couple of
// callbacks. Charts on one page share uPlot's cursor sync key, which is the shared step cursor.

const SYNC_KEY = "rankwatch-step";

function markerPlugin(handle) {
  // Incident spans and non-finite steps, drawn under the series on every redraw.
  return {
    hooks: {
      drawClear: [
        (u) => {
          const spec = handle.spec;
          const ctx = u.ctx;
          const { left, top, width, height } = u.bbox;
          ctx.save();
          ctx.beginPath();
          ctx.rect(left, top, width, height);
          ctx.clip();
          // One band per incident; labels go in the first of three rows where they do not
          // touch a label already placed, and are left off (the band and its hover stay) where
          // no row has room.
          const rowEnds = [-Infinity, -Infinity, -Infinity];
          const placed = [];
          ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
          const bands = [...(spec.marks || [])].sort((a, b) => a.from - b.from);
          for (const m of bands) {
            let x0 = u.valToPos(m.from, "x", true);
            let x1 = u.valToPos(m.to, "x", true);
            if (x1 < left || x0 > left + width) continue;
            if (x1 - x0 < 2 * devicePixelRatio) {
              x0 -= devicePixelRatio;
              x1 = x0 + 2 * devicePixelRatio;
            }
            ctx.fillStyle = m.color + "33";
            ctx.fillRect(x0, top, x1 - x0, height);
            ctx.fillStyle = m.color;
            ctx.fillRect(x0, top, 2 * devicePixelRatio, height);
            const lx = Math.max(x0, left) + 4 * devicePixelRatio;
            const lw = ctx.measureText(m.label).width;
            const row = rowEnds.findIndex((end) => lx >= end + 6 * devicePixelRatio);
            if (row < 0) continue;
            rowEnds[row] = lx + lw;
            ctx.fillText(m.label, lx, top + (12 + 13 * row) * devicePixelRatio);
            placed.push({ id: m.id, x0: lx / devicePixelRatio, x1: (lx + lw) / devicePixelRatio, row });
          }
          handle.el.dataset.bands = String((spec.marks || []).length);
          handle.el.dataset.bandLabels = JSON.stringify(placed);
          for (const x of spec.nonfinite || []) {
            const px = u.valToPos(x, "x", true);
            ctx.fillStyle = "#d0021b";
            ctx.beginPath();
            ctx.arc(px, top + height - 6 * devicePixelRatio, 4 * devicePixelRatio, 0, 2 * Math.PI);
            ctx.fill();
          }
          for (const l of spec.lines || []) {
            const py = u.valToPos(l.y, "y", true);
            if (!(py >= top && py <= top + height)) continue;
            ctx.strokeStyle = l.color;
            ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
            ctx.lineWidth = devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(left, py);
            ctx.lineTo(left + width, py);
            ctx.stroke();
            ctx.setLineDash([]);
            ctx.fillStyle = l.color;
            ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
            ctx.fillText(l.label, left + 4 * devicePixelRatio, py - 3 * devicePixelRatio);
          }
          if (spec.selected != null) {
            const px = u.valToPos(spec.selected, "x", true);
            ctx.strokeStyle = "#555";
            ctx.lineWidth = devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(px, top);
            ctx.lineTo(px, top + height);
            ctx.stroke();
          }
          ctx.restore();
        },
      ],
    },
  };
}

function options(handle, el, spec) {
  return {
    width: Math.max(200, el.clientWidth),
    height: spec.height || 220,
    title: spec.title,
    scales: {
      x: { time: false },
      y: spec.log ? { distr: 3 } : {},
    },
    legend: { live: true },
    cursor: {
      sync: { key: SYNC_KEY, setSeries: false },
      drag: { x: true, y: false, setScale: false },
      points: { size: 5 },
    },
    axes: [
      { label: "step", labelSize: 16, size: 36 },
      { size: 64, values: (u, vals) => vals.map(fmt) },
    ],
    series: [
      { label: "step", value: (u, v) => (v == null ? "–" : String(Math.round(v))) },
      ...spec.series.map((s) => ({
        label: s.label,
        stroke: s.color,
        width: s.width || 1.25,
        dash: s.dash || undefined,
        spanGaps: true,
        points: { show: false },
        value: (u, v) => (v == null ? "–" : fmt(v)),
      })),
    ],
    plugins: [markerPlugin(handle)],
    hooks: {
      // Details of the incidents under the cursor, as the plot's tooltip.
      setCursor: [
        (u) => {
          const left = u.cursor.left;
          const at = left == null || left < 0 ? null : u.posToVal(left, "x");
          const under = at == null ? [] : (handle.spec.marks || []).filter((m) => m.from - 0.5 <= at && at <= m.to + 0.5);
          const text = under.map((m) => m.detail).join("\n\n");
          if (text) u.over.title = text;
          else u.over.removeAttribute("title");
        },
      ],
      setSelect: [
        (u) => {
          if (u.select.width > 4) {
            const lo = u.posToVal(u.select.left, "x");
            const hi = u.posToVal(u.select.left + u.select.width, "x");
            u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
            handle.dragged = true;
            handle.onZoom(Math.floor(lo), Math.ceil(hi));
          }
        },
      ],
    },
  };
}

export function fmt(v) {
  if (v == null || Number.isNaN(v)) return "NaN";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  return v.toPrecision(3);
}

function data(spec) {
  return [spec.x, ...spec.ys];
}

function shapeOf(spec) {
  return JSON.stringify([spec.title, spec.log, spec.series]);
}

export function chartCreate(el, specJson, onZoom, onPick) {
  const spec = JSON.parse(specJson);
  const handle = { el, spec, onZoom, onPick, shape: shapeOf(spec), dragged: false };
  handle.plot = new uPlot(options(handle, el, spec), data(spec), el);
  // A click (not the end of a drag) picks the step under the cursor.
  handle.plot.over.addEventListener("click", () => {
    if (handle.dragged) {
      handle.dragged = false;
      return;
    }
    const idx = handle.plot.cursor.idx;
    if (idx != null && handle.spec.x[idx] != null) handle.onPick(handle.spec.x[idx]);
  });
  handle.resize = new ResizeObserver(() => {
    const w = Math.max(200, el.clientWidth);
    if (w !== handle.plot.width) handle.plot.setSize({ width: w, height: handle.plot.height });
  });
  handle.resize.observe(el);
  mark(el, spec);
  return handle;
}

export function chartUpdate(handle, specJson) {
  const spec = JSON.parse(specJson);
  const shape = shapeOf(spec);
  handle.spec = spec;
  if (shape !== handle.shape) {
    handle.shape = shape;
    handle.plot.destroy();
    handle.plot = new uPlot(options(handle, handle.el, spec), data(spec), handle.el);
  } else {
    handle.plot.setData(data(spec));
  }
  mark(handle.el, spec);
}

// What was drawn, on the element: tests and the load benchmark read it.
function mark(el, spec) {
  el.dataset.points = String(spec.x.length);
  el.dataset.series = String(spec.series.length);
  el.dataset.from = spec.x.length ? String(spec.x[0]) : "";
  el.dataset.to = spec.x.length ? String(spec.x[spec.x.length - 1]) : "";
  el.dataset.drawn = String(performance.now());
}

export function chartDestroy(handle) {
  handle.resize.disconnect();
  handle.plot.destroy();
}

// --- heatmap ---------------------------------------------------------------------------

const VIRIDIS = [
  [68, 1, 84],
  [59, 82, 139],
  [33, 145, 140],
  [94, 201, 98],
  [253, 231, 37],
];

function colour(t) {
  t = Math.min(1, Math.max(0, t));
  const p = t * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(p));
  const f = p - i;
  const a = VIRIDIS[i];
  const b = VIRIDIS[i + 1];
  return `rgb(${a.map((c, k) => Math.round(c + (b[k] - c) * f)).join(",")})`;
}

function position(scale, v) {
  if (scale.kind === "log") {
    const lo = Math.log(Math.max(scale.min, 1e-12));
    const hi = Math.log(Math.max(scale.max, 1e-12));
    return hi > lo ? (Math.log(Math.max(v, 1e-12)) - lo) / (hi - lo) : 0.5;
  }
  return scale.max > scale.min ? (v - scale.min) / (scale.max - scale.min) : 0.5;
}

const LABEL_W = 64;
const AXIS_H = 22;

export function heatmapDraw(canvas, specJson, onPick) {
  const spec = JSON.parse(specJson);
  const rows = spec.rows.length;
  const cols = spec.cols.length;
  const width = Math.max(300, canvas.parentElement.clientWidth);
  const rowH = Math.max(4, Math.min(24, Math.floor(560 / Math.max(rows, 1))));
  const height = rows * rowH + AXIS_H;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, width, height);
  const cellW = (width - LABEL_W) / Math.max(cols, 1);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  const outOfBand = [];
  for (let r = 0; r < rows; r++) {
    ctx.fillStyle = r === spec.selectedRow ? "#000" : "#444";
    ctx.fillText(spec.rows[r], 4, r * rowH + rowH / 2);
    for (let c = 0; c < cols; c++) {
      const v = spec.values[r][c];
      const bad = spec.nonfinite[r][c] > 0;
      let fill;
      if (bad) fill = "#d0021b";
      else if (v == null) fill = "#eee";
      else fill = colour(position(spec.scale, v));
      ctx.fillStyle = fill;
      const x = LABEL_W + c * cellW;
      ctx.fillRect(x, r * rowH, Math.ceil(cellW), rowH - (rowH > 6 ? 1 : 0));
      if (!bad && v != null && spec.band && (v < spec.band.low || v > spec.band.high)) {
        outOfBand.push([x, r * rowH]);
      }
    }
  }
  // Cells outside the configured healthy band: outlined, so they read at any colour.
  ctx.strokeStyle = "#ff2d55";
  ctx.lineWidth = 1;
  for (const [x, y] of outOfBand) ctx.strokeRect(x + 0.5, y + 0.5, Math.max(1, cellW - 1), rowH - 2);
  if (spec.selectedRow != null && spec.selectedRow >= 0) {
    ctx.strokeStyle = "#000";
    ctx.lineWidth = 2;
    ctx.strokeRect(LABEL_W, spec.selectedRow * rowH, width - LABEL_W, rowH);
  }
  if (spec.selectedCol != null && spec.selectedCol >= 0) {
    ctx.strokeStyle = "#000";
    ctx.lineWidth = 2;
    ctx.strokeRect(LABEL_W + spec.selectedCol * cellW, 0, Math.max(2, cellW), rows * rowH);
  }
  // Step axis: about one label per 120 px.
  ctx.fillStyle = "#444";
  ctx.textBaseline = "top";
  const every = Math.max(1, Math.round(cols / Math.max(1, (width - LABEL_W) / 120)));
  for (let c = 0; c < cols; c += every) {
    ctx.fillText(String(spec.cols[c]), LABEL_W + c * cellW, rows * rowH + 4);
  }
  canvas.dataset.rows = String(rows);
  canvas.dataset.cols = String(cols);
  canvas.dataset.drawn = String(performance.now());

  const cellAt = (ev) => {
    const rect = canvas.getBoundingClientRect();
    const x = ev.clientX - rect.left;
    const y = ev.clientY - rect.top;
    const c = Math.floor((x - LABEL_W) / cellW);
    const r = Math.floor(y / rowH);
    if (c < 0 || c >= cols || r < 0 || r >= rows) return null;
    return [r, c];
  };
  canvas.onclick = (ev) => {
    const cell = cellAt(ev);
    if (cell) onPick(cell[0], cell[1]);
  };
  const tip = canvas.parentElement.querySelector(".heat-tip");
  canvas.onmousemove = (ev) => {
    if (!tip) return;
    const cell = cellAt(ev);
    if (!cell) {
      tip.style.display = "none";
      return;
    }
    const [r, c] = cell;
    const v = spec.values[r][c];
    const nf = spec.nonfinite[r][c];
    const to = c + 1 < cols ? spec.cols[c + 1] - 1 : spec.lastStep;
    const carried = spec.filled[r][c] ? " (no probe here: the previous probe's value)" : "";
    tip.textContent = `${spec.rows[r]}, steps ${spec.cols[c]}–${to}: ${
      nf > 0 ? `${nf} non-finite` : v == null ? "no data" : fmt(v) + carried
    }`;
    tip.style.display = "block";
    tip.style.left = `${ev.offsetX + 12}px`;
    tip.style.top = `${ev.offsetY + 12}px`;
  };
  canvas.onmouseleave = () => {
    if (tip) tip.style.display = "none";
  };
}
