"use strict";
// A small SVG line chart (no library): series of [time, value] drawn against a shared time axis, and horizontal
// limit lines. Everything is built with createElementNS and attributes: no markup is parsed, no inline style.
(function () {
  const NS = "http://www.w3.org/2000/svg";

  function element(name, attributes, text) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // series: [{label, cls, points: [[t, v], ...]}]; limits: [{label, cls, value}]; span: seconds shown.
  function lineChart(series, limits, options) {
    const width = options.width || 420, height = options.height || 140, pad = {l: 54, r: 8, t: 8, b: 18};
    const span = options.span || 120, now = options.now;
    const format = options.format || String;
    let top = 0;
    for (const s of series) for (const [, v] of s.points) top = Math.max(top, v);
    for (const l of limits) if (l.value > 0) top = Math.max(top, l.value);
    top = top > 0 ? top * 1.08 : 1;
    const x = (t) => pad.l + (width - pad.l - pad.r) * (1 - (now - t) / span);
    const y = (v) => pad.t + (height - pad.t - pad.b) * (1 - v / top);
    const svg = element("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
      "aria-label": options.label || "chart"});
    for (const fraction of [0, 0.5, 1]) {
      const value = top * fraction;
      svg.append(element("line", {x1: pad.l, x2: width - pad.r, y1: y(value), y2: y(value), class: "grid"}));
      svg.append(element("text", {x: pad.l - 4, y: y(value) + 4, class: "axis", "text-anchor": "end"}, format(value)));
    }
    svg.append(element("text", {x: pad.l, y: height - 4, class: "axis"}, `-${span} s`));
    svg.append(element("text", {x: width - pad.r, y: height - 4, class: "axis", "text-anchor": "end"}, "now"));
    for (const l of limits) {
      if (!(l.value > 0)) continue;
      svg.append(element("line", {x1: pad.l, x2: width - pad.r, y1: y(l.value), y2: y(l.value), class: `limit ${l.cls}`}));
      svg.append(element("text", {x: width - pad.r - 2, y: y(l.value) - 3, class: `axis ${l.cls}`, "text-anchor": "end"},
        `${l.label} ${format(l.value)}`));
    }
    for (const s of series) {
      const points = s.points.filter(([t]) => now - t <= span);
      if (!points.length) continue;
      const path = points.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
      svg.append(element("path", {d: path, class: `series ${s.cls}`, "data-series": s.label}));
    }
    return svg;
  }

  window.MlxChart = {lineChart};
})();
