// Line charts on a true time axis: each sample is drawn at its own time, a gap in the samples
// stays a gap (no line across it), lines are straight (no smoothing above or below the data).
"use strict";

const Timeline = (() => {
  const palette = ["#3056d3", "#1f7a4d", "#b42318", "#a15c00", "#6941c6", "#0e7090", "#667085"];
  const { format } = Atrium;

  // {x: ms, y} for each point; a missing sample between two far apart breaks the line.
  function series(points, value, gapMs) {
    const data = [];
    let last = null;
    for (const p of points) {
      const x = Date.parse(p.at);
      if (last !== null && x - last > gapMs) data.push({ x: (x + last) / 2, y: null });
      const y = value(p);
      data.push({ x, y: y === undefined ? null : y });
      last = x;
    }
    return data;
  }

  // A value with no neighbour draws no segment: it gets a dot instead.
  function isolated(ctx) {
    const d = ctx.dataset.data;
    const i = ctx.dataIndex;
    const y = (k) => (d[k] ? d[k].y : null);
    return y(i) !== null && y(i - 1) === null && y(i + 1) === null;
  }

  function line(label, data, i, extra = {}) {
    const color = palette[i % palette.length];
    return { label, data, borderColor: color, backgroundColor: color, borderWidth: 2,
      pointRadius: (ctx) => (isolated(ctx) ? 3 : 0), spanGaps: false, tension: 0, ...extra };
  }

  function clock(ms, seconds) {
    const options = { hour12: false, hour: "2-digit", minute: "2-digit" };
    if (seconds) options.second = "2-digit";
    return new Date(ms).toLocaleTimeString([], options);
  }

  // A chart whose x axis spans [min, max] milliseconds (the chosen range, up to now).
  function draw(canvas, datasets, min, max, existing) {
    const span = max - min;
    if (existing) {
      existing.data.datasets = datasets;
      existing.options.scales.x.min = min;
      existing.options.scales.x.max = max;
      existing.update("none");
      return existing;
    }
    return new Chart(canvas, {
      type: "line",
      data: { datasets },
      options: {
        animation: false,
        maintainAspectRatio: false,
        parsing: true,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        scales: {
          x: { type: "linear", min, max,
            ticks: { maxRotation: 0, maxTicksLimit: 6, callback: (v) => clock(v, span <= 10 * 60e3) } },
          y: { beginAtZero: true, min: 0, ticks: { callback: (v) => format.dec(v) } },
        },
        plugins: {
          legend: { labels: { boxWidth: 12 } },
          tooltip: { callbacks: {
            title: (items) => (items.length ? clock(items[0].parsed.x, true) : ""),
            label: (c) => `${c.dataset.label}: ${format.dec(c.parsed.y)}`,
          } },
        },
      },
    });
  }

  return { series, line, draw, palette };
})();
