// Live: the server's last hour of samples (/admin/v1/metrics/live), polled for new ones and
// drawn on a true time axis over the chosen range.
"use strict";

(() => {
  const intervalMs = 2000;
  const maxTenants = 6; // the busiest; the rest are summed as "other tenants"
  const { api, notice, format } = Atrium;
  const { series, line, draw: drawChart } = Timeline;
  const points = [];
  let names = {};
  let missing = [];
  let lastAt = null;
  let historyMs = 3600e3;
  let gapMs = 6000; // samples further apart than this are not joined by a line
  const charts = {};
  const range = document.getElementById("live-range");

  // Why a chart is empty when the server reports nothing for it.
  const MISSING_NOTES = {
    engine: "No engine reports to this gateway: no token rate, queue or KV pages to draw.",
    ttft: "This server reports no time-to-first-token histogram.",
    itl: "This server reports no inter-token latency histogram.",
    refusals: "This server does not count refusals by reason yet (no refusal counter in /metrics).",
    requests: "This server does not count finished requests (no request counter in /metrics).",
  };
  const NEEDS = { requests: "requests", tokens: "engine", ttft: "ttft", itl: "itl", queue: "engine",
    kv: "engine", refusals: "refusals" };
  const IDLE_NOTES = {
    requests: "No requests finished in this range.",
    tokens: "No tokens processed in this window.",
    ttft: "No first tokens in this window.",
    itl: "No tokens streamed in this window.",
    queue: "No tenant has requests running or waiting.",
    kv: "No tenant holds KV pages.",
    refusals: "No refusals in this window.",
  };

  const ms = (s) => (s === null || s === undefined ? null : s * 1000);
  // The range chosen, up to the last sample; no earlier than the first sample kept.
  const inRange = () => {
    const minutes = Number(range?.value || 15);
    if (!points.length) return [Date.now() - minutes * 60e3, Date.now()];
    const end = Date.parse(points[points.length - 1].at);
    return [Math.max(end - minutes * 60e3, Date.parse(points[0].at)), end];
  };
  const shown = () => {
    const [min] = inRange();
    return points.filter((p) => Date.parse(p.at) >= min);
  };

  // The busiest tenants over the points (by a per-point value), then the rest as one line.
  function byTenant(value, visible) {
    const totals = new Map();
    for (const p of visible) {
      for (const t of p.tenants) totals.set(t.tenant_id, (totals.get(t.tenant_id) ?? 0) + value(t));
    }
    const top = [...totals.entries()].filter(([, v]) => v > 0).sort((a, b) => b[1] - a[1])
      .slice(0, maxTenants).map(([id]) => id);
    const rest = [...totals.entries()].some(([id, v]) => v > 0 && !top.includes(id));
    const zero = { running: 0, waiting: 0, kv_pages: 0 };
    const lines = top.map((id) => ({
      name: names[id] ?? id,
      data: series(visible, (p) => value(p.tenants.find((t) => t.tenant_id === id) ?? zero), gapMs),
    }));
    if (rest) {
      lines.push({
        name: "other tenants",
        data: series(visible, (p) => p.tenants.filter((t) => !top.includes(t.tenant_id))
          .reduce((acc, t) => acc + value(t), 0), gapMs),
      });
    }
    return lines;
  }

  function datasets(kind, visible) {
    const of = (value) => series(visible, value, gapMs);
    switch (kind) {
      case "requests":
        return [line("finished", of((p) => p.requests_per_s), 0),
          line("errors", of((p) => p.errors_per_s), 2)];
      case "tokens":
        return [line("prompt", of((p) => p.prompt_tokens_per_s), 0),
          line("generated", of((p) => p.generated_tokens_per_s), 1)];
      case "ttft":
      case "itl":
        return [line("p50", of((p) => ms(p[`${kind}_p50_s`])), 0),
          line("p99", of((p) => ms(p[`${kind}_p99_s`])), 2)];
      case "queue": {
        const running = byTenant((t) => t.running, visible);
        const waiting = byTenant((t) => t.waiting, visible);
        return [...running.map((s, i) => line(`${s.name} running`, s.data, i)),
          ...waiting.map((s, i) => line(`${s.name} waiting`, s.data, i, { borderDash: [5, 4] }))];
      }
      case "kv":
        return byTenant((t) => t.kv_pages, visible).map((s, i) => line(s.name, s.data, i));
      case "refusals": {
        const reasons = [...new Set(visible.flatMap((p) => Object.keys(p.refusals_per_min ?? {})))].sort();
        return reasons.map((r, i) => line(r, of((p) => p.refusals_per_min?.[r] ?? null), i));
      }
      default:
        return [];
    }
  }

  function hasData(sets) {
    return sets.some((d) => d.data.some((v) => v.y !== null && v.y > 0));
  }

  function draw(panel) {
    const kind = panel.dataset.chart;
    const absent = missing.includes(NEEDS[kind]);
    const sets = absent ? [] : datasets(kind, shown());
    const note = panel.querySelector(".chart-note");
    const noteText = absent ? MISSING_NOTES[NEEDS[kind]] : hasData(sets) ? "" : IDLE_NOTES[kind];
    note.textContent = noteText;
    note.hidden = !noteText;
    panel.dataset.state = absent ? "missing" : hasData(sets) ? "data" : "idle";
    const [min, max] = inRange();
    charts[kind] = drawChart(panel.querySelector("canvas"), sets, min, max, charts[kind]);
  }

  function redraw() {
    for (const panel of document.querySelectorAll("[data-chart]")) draw(panel);
  }

  async function poll() {
    const query = lastAt ? `?${new URLSearchParams({ since: lastAt })}` : "";
    try {
      const state = await api("GET", `${Atrium.apiRoot}/metrics/live${query}`);
      names = state.tenant_names;
      missing = state.missing;
      historyMs = state.history_s * 1000;
      gapMs = state.interval_s * 1000 * 3;
      points.push(...state.points);
      if (points.length) lastAt = points[points.length - 1].at;
      const oldest = Date.parse(lastAt ?? new Date().toISOString()) - historyMs;
      while (points.length && Date.parse(points[0].at) < oldest) points.shift();
      document.getElementById("live-window").textContent = format.int(state.latency_window_s);
      document.getElementById("live-interval").textContent = format.dec(state.interval_s);
      redraw();
      document.body.dataset.livePoints = String(points.length);
      document.getElementById("live-updated").textContent = new Date().toLocaleTimeString();
      notice("");
    } catch (error) {
      notice(`Live metrics unavailable: ${error.message}`);
    }
  }

  range?.addEventListener("change", redraw);
  poll();
  window.setInterval(poll, intervalMs);
})();
