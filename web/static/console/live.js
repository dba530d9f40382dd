// Live: polls /admin/v1/metrics/live and draws six line charts from the points kept here.
"use strict";

(() => {
  const intervalMs = 2000;
  const maxPoints = 300;
  const maxTenants = 6; // the busiest; the rest are summed as "other tenants"
  const palette = ["#3056d3", "#1f7a4d", "#b42318", "#a15c00", "#6941c6", "#0e7090", "#667085"];
  const { api, notice, format } = Atrium;
  const points = [];
  let names = {};
  let missing = [];
  let lastAt = null;
  const charts = {};

  // Why a chart is empty when the server reports nothing for it.
  const MISSING_NOTES = {
    engine: "No engine reports to this gateway: no token rate, queue or KV pages to draw.",
    ttft: "This server reports no time-to-first-token histogram.",
    itl: "This server reports no inter-token latency histogram.",
    refusals: "This server does not count refusals by reason yet (no refusal counter in /metrics).",
  };
  const NEEDS = { tokens: "engine", ttft: "ttft", itl: "itl", queue: "engine", kv: "engine", refusals: "refusals" };
  const IDLE_NOTES = {
    tokens: "No tokens processed in this window.",
    ttft: "No first tokens in this window.",
    itl: "No tokens streamed in this window.",
    queue: "No tenant has requests running or waiting.",
    kv: "No tenant holds KV pages.",
    refusals: "No refusals in this window.",
  };

  const label = (p) => new Date(p.at).toLocaleTimeString([], { hour12: false });
  const ms = (s) => (s === null || s === undefined ? null : s * 1000);

  // A value with no neighbour draws no line segment: it gets a dot instead.
  function isolated(ctx) {
    const d = ctx.dataset.data;
    const i = ctx.dataIndex;
    return d[i] !== null && d[i] !== undefined && d[i - 1] == null && d[i + 1] == null;
  }

  function line(name, data, i, extra = {}) {
    const color = palette[i % palette.length];
    return { label: name, data, borderColor: color, backgroundColor: color, borderWidth: 2,
      pointRadius: (ctx) => (isolated(ctx) ? 3 : 0), spanGaps: false, tension: 0.2, ...extra };
  }

  // The busiest tenants over the points (by a per-point value), then the rest as one line.
  function byTenant(value) {
    const totals = new Map();
    for (const p of points) {
      for (const t of p.tenants) totals.set(t.tenant_id, (totals.get(t.tenant_id) ?? 0) + value(t));
    }
    const top = [...totals.entries()].filter(([, v]) => v > 0).sort((a, b) => b[1] - a[1])
      .slice(0, maxTenants).map(([id]) => id);
    const rest = [...totals.entries()].some(([id, v]) => v > 0 && !top.includes(id));
    const series = top.map((id) => ({
      name: names[id] ?? id,
      data: points.map((p) => value(p.tenants.find((t) => t.tenant_id === id) ?? { running: 0, waiting: 0, kv_pages: 0 })),
    }));
    if (rest) {
      series.push({
        name: "other tenants",
        data: points.map((p) => p.tenants.filter((t) => !top.includes(t.tenant_id))
          .reduce((acc, t) => acc + value(t), 0)),
      });
    }
    return series;
  }

  function datasets(kind) {
    switch (kind) {
      case "tokens":
        return [line("prompt", points.map((p) => p.prompt_tokens_per_s), 0),
          line("generated", points.map((p) => p.generated_tokens_per_s), 1)];
      case "ttft":
      case "itl":
        return [line("p50", points.map((p) => ms(p[`${kind}_p50_s`])), 0),
          line("p99", points.map((p) => ms(p[`${kind}_p99_s`])), 2)];
      case "queue": {
        const running = byTenant((t) => t.running);
        const waiting = byTenant((t) => t.waiting);
        return [...running.map((s, i) => line(`${s.name} running`, s.data, i)),
          ...waiting.map((s, i) => line(`${s.name} waiting`, s.data, i, { borderDash: [5, 4] }))];
      }
      case "kv":
        return byTenant((t) => t.kv_pages).map((s, i) => line(s.name, s.data, i));
      case "refusals": {
        const reasons = [...new Set(points.flatMap((p) => Object.keys(p.refusals_per_min ?? {})))].sort();
        return reasons.map((r, i) => line(r, points.map((p) => p.refusals_per_min?.[r] ?? null), i));
      }
      default:
        return [];
    }
  }

  function hasData(sets) {
    return sets.some((d) => d.data.some((v) => v !== null && v !== undefined && v > 0));
  }

  function draw(panel) {
    const kind = panel.dataset.chart;
    const absent = missing.includes(NEEDS[kind]);
    const sets = absent ? [] : datasets(kind);
    const note = panel.querySelector(".chart-note");
    const noteText = absent ? MISSING_NOTES[NEEDS[kind]] : hasData(sets) ? "" : IDLE_NOTES[kind];
    note.textContent = noteText;
    note.hidden = !noteText;
    panel.dataset.state = absent ? "missing" : hasData(sets) ? "data" : "idle";
    const data = { labels: points.map(label), datasets: sets };
    if (charts[kind]) {
      charts[kind].data = data;
      charts[kind].update("none");
      return;
    }
    charts[kind] = new Chart(panel.querySelector("canvas"), {
      type: "line",
      data,
      options: {
        animation: false,
        maintainAspectRatio: false,
        interaction: { mode: "index", intersect: false },
        scales: {
          x: { ticks: { maxRotation: 0, autoSkip: true, maxTicksLimit: 6 } },
          y: { beginAtZero: true, ticks: { callback: (v) => format.dec(v) } },
        },
        plugins: {
          legend: { labels: { boxWidth: 12 } },
          tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${format.dec(c.parsed.y)}` } },
        },
      },
    });
  }

  async function poll() {
    const query = lastAt ? `?${new URLSearchParams({ since: lastAt })}` : "";
    try {
      const state = await api("GET", `${Atrium.apiRoot}/metrics/live${query}`);
      names = state.tenant_names;
      missing = state.missing;
      points.push(...state.points);
      points.splice(0, Math.max(0, points.length - maxPoints));
      if (points.length) lastAt = points[points.length - 1].at;
      document.getElementById("live-window").textContent = format.int(state.latency_window_s);
      for (const panel of document.querySelectorAll("[data-chart]")) draw(panel);
      document.body.dataset.livePoints = String(points.length);
      document.getElementById("live-updated").textContent = new Date().toLocaleTimeString();
      notice("");
    } catch (error) {
      notice(`Live metrics unavailable: ${error.message}`);
    }
  }

  document.getElementById("live-interval").textContent = intervalMs / 1000;
  poll();
  window.setInterval(poll, intervalMs);
})();
