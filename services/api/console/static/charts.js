// pagoda console: small line charts on a canvas (no library): the last ten minutes of a few series.
"use strict";

PG.Chart = class {
  // series: [{label, color, field, scale}] (value = row[field] * scale); options: {max, unit, spanS}
  constructor(canvas, series, options) {
    this.canvas = canvas;
    this.series = series;
    this.options = Object.assign({ spanS: 600, unit: "" }, options || {});
  }

  draw(history) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;  // hidden tab: drawn when shown
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const rows = history.rows;
    const at = (name) => history.fields.indexOf(name);
    const tIndex = at("t");
    const now = rows.length ? rows[rows.length - 1][tIndex] : Date.now() / 1000;
    const start = now - this.options.spanS;
    const columns = this.series.map((s) => ({ s, i: at(s.field) }));
    let top = this.options.max || 0;
    if (!this.options.max) {
      for (const row of rows) {
        for (const { s, i } of columns) {
          const v = row[i];
          if (v !== null && v !== undefined) top = Math.max(top, v * (s.scale || 1));
        }
      }
      top = niceCeiling(top);
    }
    const left = 44, right = 8, upper = 16, lower = 16;
    const plotW = width - left - right, plotH = height - upper - lower;
    const x = (t) => left + ((t - start) / this.options.spanS) * plotW;
    const y = (v) => upper + plotH - (top > 0 ? (v / top) * plotH : 0);

    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#e1e4ea";
    g.fillStyle = "#667085";
    g.lineWidth = 1;
    for (let k = 0; k <= 4; k++) {
      const v = (top * k) / 4;
      const py = Math.round(y(v)) + 0.5;
      g.beginPath(); g.moveTo(left, py); g.lineTo(width - right, py); g.stroke();
      g.textAlign = "right";
      g.fillText(shortNumber(v) + this.options.unit, left - 4, py + 4);
    }
    g.textAlign = "center";
    for (let m = 0; m <= 10; m += 2) g.fillText(m === 0 ? "now" : `-${m}m`, x(now - m * 60), height - 3);

    for (const { s, i } of columns.slice().reverse()) {  // the first series on top
      g.strokeStyle = s.color;
      g.lineWidth = 1.6;
      g.beginPath();
      let pen = false;
      for (const row of rows) {
        const t = row[tIndex], v = row[i];
        if (t < start || v === null || v === undefined) { pen = false; continue; }
        const px = x(t), py = y(Math.min(v * (s.scale || 1), top));
        if (pen) g.lineTo(px, py); else g.moveTo(px, py);
        pen = true;
      }
      g.stroke();
    }
    let lx = left + 6;
    g.textAlign = "left";
    for (const { s } of columns) {
      g.fillStyle = s.color;
      g.fillRect(lx, 4, 9, 9);
      g.fillStyle = "#1d2330";
      g.fillText(s.label, lx + 12, 12);
      lx += 20 + g.measureText(s.label).width;
    }
  }
};

function niceCeiling(value) {
  if (value <= 0) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value * 1.05) return step * power;
  return 10 * power;
}

function shortNumber(value) {
  if (value >= 1e6) return (value / 1e6).toFixed(value >= 1e7 ? 0 : 1) + "M";
  if (value >= 1e3) return (value / 1e3).toFixed(value >= 1e4 ? 0 : 1) + "k";
  return value >= 10 || value === 0 ? value.toFixed(0) : value.toFixed(1);
}
