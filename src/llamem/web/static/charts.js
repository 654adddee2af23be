// llamem charts: inline SVG drawn from the JSON that `llamem estimate|plan --json` prints.
// Shared by the `llamem serve` page and the self-contained `--html` reports; no library.
"use strict";
(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const GIB = 2 ** 30;
  const COLORS = {
    "weights": "#4e79a7", "weights/adapters": "#86bcb6", "weights/autocast_copies": "#a0cbe8",
    "weights/teacher": "#2f5f8a", "gradients": "#f28e2b", "optimizer": "#e15759", "activations": "#59a14f",
    "logits": "#edc948", "kv_cache": "#b07aa1", "temporaries": "#ff9da7", "inputs": "#9c755f",
    "allocator reserve": "#c9c9c9", "CUDA context (non-torch)": "#8c8c8c",
  };
  const SPARE = ["#d37295", "#499894", "#f1ce63", "#79706e", "#8cd17d", "#b6992d", "#fabfd2", "#d4a6c8"];
  const OPTIMIZER_SHADES = ["#e15759", "#f08a8b", "#b83b3d", "#f5b0b1"];

  function gib(bytes, digits) {
    if (bytes === null || bytes === undefined) return "–";
    const d = digits === undefined ? 2 : digits;
    return (bytes / GIB).toFixed(d) + " GiB";
  }

  function colorOf(key, index) {
    if (COLORS[key]) return COLORS[key];
    if (key.startsWith("optimizer/")) return OPTIMIZER_SHADES[index % OPTIMIZER_SHADES.length];
    const top = key.split("/")[0];
    if (COLORS[top] && !key.includes("/")) return COLORS[top];
    let h = 0;
    for (const c of key) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return SPARE[h % SPARE.length];
  }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function html(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceStep(max) {
    const raw = max / GIB / 5;
    const power = 10 ** Math.floor(Math.log10(raw || 1));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
    return step * GIB;
  }

  // A horizontal chart frame: rows of bars with labels, a GiB axis and an optional capacity line.
  function frame(container, rows, maxBytes, capacity, labelChars) {
    const width = Math.max(container.clientWidth || 720, 300);
    const narrow = width < 560;
    const labelWidth = narrow ? 0 : Math.min(labelChars * 7.2 + 12, width * 0.45);
    const rowHeight = narrow ? 46 : 34;
    const top = capacity ? 22 : 8;
    const plotLeft = labelWidth + 8, plotRight = width - 12;
    const height = top + rows * rowHeight + 26;
    const svg = el("svg", { width: width, height: height, viewBox: `0 0 ${width} ${height}`, role: "img",
      class: "chart" });
    const x = (bytes) => plotLeft + (plotRight - plotLeft) * Math.max(0, bytes) / maxBytes;
    const step = niceStep(maxBytes);
    for (let t = 0; t <= maxBytes * 1.0001; t += step) {
      svg.appendChild(el("line", { x1: x(t), x2: x(t), y1: top, y2: height - 22, class: "grid" }));
      svg.appendChild(el("text", { x: x(t), y: height - 6, "text-anchor": "middle", class: "tick" },
        (t / GIB).toFixed(step < GIB ? 1 : 0)));
    }
    svg.appendChild(el("text", { x: plotRight, y: height - 6, "text-anchor": "end", class: "tick unit" }, "GiB"));
    const rowBox = (i) => narrow
      ? { labelX: plotLeft, labelY: top + i * rowHeight + 13, barY: top + i * rowHeight + 18, barH: rowHeight - 24 }
      : { labelX: labelWidth, labelY: top + i * rowHeight + rowHeight / 2 + 4, barY: top + i * rowHeight + 6,
          barH: rowHeight - 12 };
    return { svg, x, rowBox, narrow, plotRight, top, height, capacityLine() {
      if (!capacity) return;
      const cx = x(capacity.bytes);
      svg.appendChild(el("line", { x1: cx, x2: cx, y1: top - 4, y2: height - 22, class: "capacity" }));
      const anchor = cx > (plotLeft + plotRight) / 2 ? "end" : "start";
      svg.appendChild(el("text", { x: cx + (anchor === "end" ? -4 : 4), y: top - 8, "text-anchor": anchor,
        class: "capacity-label" }, `${capacity.label} · ${gib(capacity.bytes)}`));
    } };
  }

  function label(f, i, text, value) {
    const box = f.rowBox(i);
    const anchor = f.narrow ? "start" : "end";
    const t = el("text", { x: box.labelX, y: box.labelY, "text-anchor": anchor, class: "row-label" });
    t.appendChild(el("tspan", {}, text));
    if (value) t.appendChild(el("tspan", { class: "row-value", dx: "6" }, value));
    f.svg.appendChild(t);
  }

  // Breakdown at the peak of each phase as stacked bars, and what the card holds at the peak.
  function phaseBars(container, est, capacity) {
    container.replaceChildren();
    const phases = Object.keys(est.phases || {});
    const peak = est.phase_breakdowns[est.peak_phase] || est.breakdown;
    const cardRow = { name: "on the card at the peak", parts: Object.assign({}, peak) };
    if (est.fragmentation_bytes) cardRow.parts["allocator reserve"] = est.fragmentation_bytes;
    if (est.non_torch_bytes) cardRow.parts["CUDA context (non-torch)"] = est.non_torch_bytes;
    const rows = phases.map((p) => ({ name: p, parts: est.phase_breakdowns[p] || {} })).concat([cardRow]);
    const keys = [];
    for (const r of rows) for (const k of Object.keys(r.parts)) if (!keys.includes(k)) keys.push(k);
    const totals = rows.map((r) => Object.values(r.parts).reduce((a, b) => a + b, 0));
    const max = Math.max(...totals, capacity ? capacity.bytes : 0) * 1.04 || GIB;
    const longest = Math.max(...rows.map((r, i) => r.name.length + 18));
    const f = frame(container, rows.length, max, capacity, longest);
    const optimizerKeys = keys.filter((k) => k.startsWith("optimizer/"));
    rows.forEach((r, i) => {
      const box = f.rowBox(i);
      let start = 0;
      const group = el("g", { class: "bar", "data-phase": r.name });
      for (const k of keys) {
        const v = r.parts[k];
        if (!v) continue;
        const rect = el("rect", { x: f.x(start), y: box.barY, height: box.barH,
          width: Math.max(f.x(start + v) - f.x(start), 0.5), fill: colorOf(k, optimizerKeys.indexOf(k)) });
        rect.appendChild(el("title", {}, `${r.name} · ${k}: ${gib(v)}`));
        group.appendChild(rect);
        start += v;
      }
      f.svg.appendChild(group);
      const isPeak = r.name === est.peak_phase;
      label(f, i, r.name + (isPeak ? " (peak)" : ""), gib(totals[i]));
    });
    f.capacityLine();
    container.appendChild(f.svg);
    container.appendChild(legend(keys.map((k) => [k, colorOf(k, optimizerKeys.indexOf(k)), cardRow.parts[k]])));
  }

  function legend(items) {
    const box = html("ul", { class: "legend" });
    for (const [name, color, bytes] of items) {
      const li = html("li");
      const swatch = html("span", { class: "swatch" });
      swatch.style.background = color;
      li.appendChild(swatch);
      li.appendChild(html("span", { class: "legend-name" }, name));
      if (bytes) li.appendChild(html("span", { class: "legend-value" }, bytes < GIB / 200 ? "<0.01 GiB" : gib(bytes)));
      box.appendChild(li);
    }
    return box;
  }

  // The plan's ladder: the start, each change as a step down (or up), and the configuration it ends on.
  function waterfall(container, plan) {
    container.replaceChildren();
    const rows = [{ name: "start", detail: plan.start.config.layout_description, from: 0,
      to: plan.start.peak_device_bytes, kind: "total" }];
    let previous = plan.start.peak_device_bytes;
    for (const s of plan.steps) {
      rows.push({ name: s.technique, detail: s.change, from: previous, to: s.peak_device_bytes,
        kind: s.peak_device_bytes <= previous ? "down" : "up", time: s.relative_step_time });
      previous = s.peak_device_bytes;
    }
    rows.push({ name: plan.fits ? "fits" : "closest plan", detail: plan.final.config.layout_description, from: 0,
      to: plan.final.peak_device_bytes, kind: plan.fits ? "fit" : "short" });
    const capacity = { bytes: plan.gpu.memory_bytes, label: plan.gpu.name };
    const max = Math.max(...rows.map((r) => Math.max(r.from, r.to)), capacity.bytes) * 1.04;
    const longest = Math.max(...rows.map((r) => r.name.length + 26));
    const f = frame(container, rows.length, max, capacity, longest);
    rows.forEach((r, i) => {
      const box = f.rowBox(i);
      const lo = Math.min(r.from, r.to), hi = Math.max(r.from, r.to);
      const rect = el("rect", { x: f.x(lo), y: box.barY, height: box.barH, width: Math.max(f.x(hi) - f.x(lo), 1.5),
        class: "step " + r.kind });
      rect.appendChild(el("title", {}, `${r.name}: ${r.detail || ""} → ${gib(r.to)}`));
      f.svg.appendChild(rect);
      if (i > 0 && i < rows.length - 1) {
        const prevBox = f.rowBox(i - 1);
        f.svg.appendChild(el("line", { x1: f.x(r.from), x2: f.x(r.from), y1: prevBox.barY + prevBox.barH,
          y2: box.barY, class: "connector" }));
      }
      const delta = r.kind === "down" || r.kind === "up" ? ` (${r.to < r.from ? "−" : "+"}${gib(Math.abs(r.to - r.from), 1)})` : "";
      label(f, i, f.narrow ? `${r.name}: ${r.detail || ""}` : r.name, gib(r.to) + delta);
    });
    f.capacityLine();
    container.appendChild(f.svg);
    const list = html("ol", { class: "ladder" });
    for (const s of plan.steps) {
      const li = html("li");
      li.appendChild(html("strong", {}, s.technique + ": "));
      li.appendChild(html("code", {}, s.change));
      li.appendChild(html("span", { class: "muted" }, ` → ${gib(s.peak_device_bytes)}, step time ×${s.relative_step_time.toFixed(2)} — ${s.reason}`));
      list.appendChild(li);
    }
    if (plan.steps.length) container.appendChild(list);
  }

  // The fewest cards of each kind that hold the workload as given.
  function fitsTable(container, fits, selected) {
    container.replaceChildren();
    const table = html("table", { class: "fits" });
    const head = html("tr");
    for (const h of ["card", "memory", "fewest cards", "per card", "layout"]) head.appendChild(html("th", {}, h));
    table.appendChild(html("thead")).appendChild(head);
    const body = html("tbody");
    for (const g of fits.gpus) {
      const tr = html("tr", { class: (g.num_gpus === 1 ? "one" : g.num_gpus ? "several" : "none") +
        (g.name === selected ? " selected" : "") });
      tr.appendChild(html("td", {}, g.name));
      tr.appendChild(html("td", { class: "num" }, gib(g.memory_bytes, 1)));
      tr.appendChild(html("td", { class: "num" }, g.num_gpus ? String(g.num_gpus) : "over 64"));
      tr.appendChild(html("td", { class: "num" }, g.device_bytes ? gib(g.device_bytes) : "–"));
      tr.appendChild(html("td", {}, g.layout || "–"));
      body.appendChild(tr);
    }
    table.appendChild(body);
    container.appendChild(table);
  }

  // The headline numbers: what one card needs, and the verdict for the chosen card.
  function summary(container, est, capacity, plan) {
    container.replaceChildren();
    const tiles = [["needed per GPU", gib(est.device_bytes), `peak allocated ${gib(est.peak_allocated_bytes)} in ${est.peak_phase}`]];
    if (capacity) {
      const free = capacity.bytes - est.device_bytes;
      tiles.push([capacity.label, gib(capacity.bytes), free >= 0 ? `fits as is, ${gib(free)} free`
        : `does not fit as is: ${gib(-free)} over`, free >= 0 ? "good" : "bad"]);
    }
    if (plan) {
      const changes = plan.steps.length;
      tiles.push(plan.fits
        ? ["plan", gib(plan.final.peak_device_bytes), changes ? `fits after ${changes} change${changes > 1 ? "s" : ""}, step time ×${plan.final.relative_step_time.toFixed(2)}` : "fits as is", "good"]
        : ["closest plan", gib(plan.final.peak_device_bytes), `shortfall ${gib(plan.shortfall_bytes)}: more GPUs or a larger card`, "bad"]);
    }
    for (const [title, value, detail, tone] of tiles) {
      const tile = html("div", { class: "tile " + (tone || "") });
      tile.appendChild(html("div", { class: "tile-title" }, title));
      tile.appendChild(html("div", { class: "tile-value" }, value));
      tile.appendChild(html("div", { class: "tile-detail" }, detail));
      container.appendChild(tile);
    }
  }

  window.LlamemCharts = { gib, phaseBars, waterfall, fitsTable, summary, colorOf };
})();
