// Usage: per-tenant token charts by hour and by day from the admin usage endpoint.
"use strict";

(() => {
  const { api, notice, format } = Atrium;
  const charts = {};
  const STEP_MS = { hour: 3600e3, day: 86400e3 };

  function floorTo(date, granularity) {
    const d = new Date(date);
    d.setUTCMinutes(0, 0, 0);
    if (granularity === "day") d.setUTCHours(0);
    return d;
  }

  // Sum the buckets of every tenant per start and fill the gaps with zeros.
  function series(buckets, start, end, granularity) {
    const byStart = new Map();
    for (const b of buckets) {
      const key = new Date(b.start).getTime();
      const sum = byStart.get(key) ?? { requests: 0, prompt: 0, cached: 0, completion: 0 };
      sum.requests += b.requests;
      sum.prompt += b.prompt_tokens;
      sum.cached += b.cached_tokens;
      sum.completion += b.completion_tokens;
      byStart.set(key, sum);
    }
    const points = [];
    for (let t = start.getTime(); t < end.getTime(); t += STEP_MS[granularity]) {
      points.push({ t, ...(byStart.get(t) ?? { requests: 0, prompt: 0, cached: 0, completion: 0 }) });
    }
    return points;
  }

  function label(t, granularity) {
    const iso = new Date(t).toISOString();
    return granularity === "hour" ? `${iso.slice(5, 10)} ${iso.slice(11, 13)}h` : iso.slice(0, 10);
  }

  function draw(granularity, points) {
    const empty = points.every((p) => p.requests === 0);
    document.getElementById(`empty-${granularity}`).hidden = !empty;
    // An empty chart only draws a meaningless axis: the message says it instead.
    document.getElementById(`chart-${granularity}`).parentElement.hidden = empty;
    const data = {
      labels: points.map((p) => label(p.t, granularity)),
      datasets: [
        { label: "Uncached prompt tokens", data: points.map((p) => p.prompt - p.cached), backgroundColor: "#3056d3" },
        { label: "Cached prompt tokens", data: points.map((p) => p.cached), backgroundColor: "#8ea6f0" },
        { label: "Completion tokens", data: points.map((p) => p.completion), backgroundColor: "#1f7a4d" },
      ],
    };
    if (charts[granularity]) charts[granularity].destroy();
    charts[granularity] = new Chart(document.getElementById(`chart-${granularity}`), {
      type: "bar",
      data,
      options: {
        animation: false,
        maintainAspectRatio: false,
        scales: {
          x: { stacked: true, ticks: { maxRotation: 0, autoSkip: true, maxTicksLimit: 12 } },
          y: { stacked: true, ticks: { precision: 0, callback: (v) => format.int(v) }, title: { display: true, text: "tokens" } },
        },
        plugins: { tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${format.int(c.parsed.y)}` } } },
      },
    });
  }

  // Totals per tenant over the buckets, largest token users first; names from the tenant picker.
  function drawTenants(buckets) {
    const names = new Map(
      [...document.getElementById("usage-form").tenant_id.options].map((o) => [o.value, o.text]));
    const sums = new Map();
    for (const b of buckets) {
      const sum = sums.get(b.tenant_id) ?? { requests: 0, prompt: 0, cached: 0, completion: 0 };
      sum.requests += b.requests;
      sum.prompt += b.prompt_tokens;
      sum.cached += b.cached_tokens;
      sum.completion += b.completion_tokens;
      sums.set(b.tenant_id, sum);
    }
    const rows = [...sums.entries()].sort(
      ([, a], [, b]) => b.prompt + b.completion - (a.prompt + a.completion));
    const body = document.querySelector("#usage-tenants tbody");
    body.replaceChildren();
    for (const [tenantId, sum] of rows) {
      const row = document.createElement("tr");
      row.dataset.tenantId = tenantId;
      const cells = [names.get(tenantId) ?? tenantId, ...[sum.requests, sum.prompt, sum.cached,
        sum.completion].map(format.int)];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (i > 0) td.className = "num";
        row.append(td);
      });
      body.append(row);
    }
    document.getElementById("usage-tenants").hidden = rows.length === 0;
    document.getElementById("usage-tenants-empty").hidden = rows.length > 0;
  }

  async function load(granularity, count, tenantId) {
    const end = new Date(floorTo(new Date(), granularity).getTime() + STEP_MS[granularity]);
    const start = new Date(end.getTime() - count * STEP_MS[granularity]);
    const params = new URLSearchParams({ start: start.toISOString(), end: end.toISOString(), granularity });
    if (tenantId) params.set("tenant_id", tenantId);
    const buckets = await api("GET", `${Atrium.apiRoot}/usage?${params}`);
    const points = series(buckets, start, end, granularity);
    draw(granularity, points);
    if (granularity === "day") drawTenants(buckets);
    return points;
  }

  async function refresh(event) {
    event?.preventDefault();
    const form = document.getElementById("usage-form");
    const tenantId = form.tenant_id.value;
    try {
      await load("hour", Number(form.hours.value) || 48, tenantId);
      const dayCount = Number(form.days.value) || 30;
      const days = await load("day", dayCount, tenantId);
      const total = (field) => days.reduce((acc, p) => acc + p[field], 0);
      document.getElementById("usage-requests").textContent = format.int(total("requests"));
      document.getElementById("usage-prompt").textContent = format.int(total("prompt"));
      document.getElementById("usage-cached").textContent = format.int(total("cached"));
      document.getElementById("usage-completion").textContent = format.int(total("completion"));
      document.getElementById("usage-cached-share").textContent =
        total("prompt") ? `${format.pct(total("cached") / total("prompt"))} of prompt tokens`
          : "no prompt tokens yet";
      for (const span of document.querySelectorAll(".usage-days")) {
        span.textContent = format.int(dayCount);
      }
      notice("");
    } catch (error) {
      notice(`Usage unavailable: ${error.message}`);
    }
  }

  document.getElementById("usage-form").addEventListener("submit", refresh);
  document.getElementById("usage-form").tenant_id.addEventListener("change", refresh);
  refresh();
})();
