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

  function row(body, cells, data = {}) {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, data);
    cells.forEach(([text, numeric]) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (numeric) td.className = "num";
      tr.append(td);
    });
    body.append(tr);
  }

  // Money per currency, e.g. "$1.20 + €0.40"; "no price" when nothing was priced.
  function cost(byCurrency) {
    const parts = Object.entries(byCurrency).filter(([c]) => c)
      .map(([currency, micros]) => format.money(micros, currency));
    return parts.length ? parts.join(" + ") : "no price";
  }

  // Sums of spend rows grouped by ``keyOf``, largest token users first.
  function group(rows, keyOf) {
    const sums = new Map();
    for (const r of rows) {
      const key = keyOf(r);
      const sum = sums.get(key) ?? { first: r, requests: 0, failed: 0, prompt: 0, cached: 0, completion: 0, cost: {} };
      sum.requests += r.requests;
      sum.failed += r.failed;
      sum.prompt += r.prompt_tokens;
      sum.cached += r.cached_tokens;
      sum.completion += r.completion_tokens;
      sum.cost[r.currency] = (sum.cost[r.currency] ?? 0) + r.cost_micros;
      sums.set(key, sum);
    }
    return [...sums.entries()].sort(([, a], [, b]) => b.prompt + b.completion - (a.prompt + a.completion));
  }

  function fill(id, groups, cells) {
    const body = document.querySelector(`#${id} tbody`);
    body.replaceChildren();
    for (const [key, sum] of groups) cells(body, key, sum);
    document.getElementById(id).hidden = groups.length === 0;
    document.getElementById(`${id}-empty`).hidden = groups.length > 0;
  }

  // Spend by tenant (with its refusals), by key and by model over the days shown.
  async function loadSpend(start, end, tenantId) {
    const names = new Map(
      [...document.getElementById("usage-form").tenant_id.options].map((o) => [o.value, o.text]));
    const params = new URLSearchParams({ start: start.toISOString(), end: end.toISOString() });
    if (tenantId) params.set("tenant_id", tenantId);
    const refusalParams = new URLSearchParams(tenantId ? { tenant_id: tenantId } : {});
    const [rows, refusals] = await Promise.all([
      api("GET", `${Atrium.apiRoot}/spend?${params}`),
      api("GET", `${Atrium.apiRoot}/refusals?${refusalParams}`),
    ]);
    const refused = new Map();
    for (const t of refusals.totals) refused.set(t.tenant_id, (refused.get(t.tenant_id) ?? 0) + t.count);
    const tenants = group(rows, (r) => r.tenant_id);
    for (const id of refused.keys()) {
      if (!tenants.some(([t]) => t === id)) tenants.push([id, { requests: 0, failed: 0, prompt: 0, cached: 0, completion: 0, cost: {} }]);
    }
    fill("usage-tenants", tenants, (body, id, sum) => row(body, [
      [names.get(id) ?? id], [format.int(sum.requests), true], [format.int(sum.failed), true],
      [format.int(sum.prompt), true], [format.int(sum.cached), true], [format.int(sum.completion), true],
      [cost(sum.cost), true], [format.int(refused.get(id) ?? 0), true]], { tenantId: id }));
    fill("usage-keys", group(rows, (r) => `${r.tenant_id} ${r.key_id ?? ""}`), (body, _, sum) => row(body, [
      [names.get(sum.first.tenant_id) ?? sum.first.tenant_id],
      [sum.first.key_name ?? sum.first.key_id ?? "no key"],
      [format.int(sum.requests), true], [format.int(sum.prompt + sum.completion), true],
      [cost(sum.cost), true]], { keyId: sum.first.key_id ?? "" }));
    fill("usage-models", group(rows, (r) => r.model), (body, model, sum) => row(body, [
      [model], [format.int(sum.requests), true], [format.int(sum.failed), true],
      [format.int(sum.prompt + sum.completion), true], [cost(sum.cost), true]], { model }));
  }

  async function load(granularity, count, tenantId) {
    const end = new Date(floorTo(new Date(), granularity).getTime() + STEP_MS[granularity]);
    const start = new Date(end.getTime() - count * STEP_MS[granularity]);
    const params = new URLSearchParams({ start: start.toISOString(), end: end.toISOString(), granularity });
    if (tenantId) params.set("tenant_id", tenantId);
    const buckets = await api("GET", `${Atrium.apiRoot}/usage?${params}`);
    const points = series(buckets, start, end, granularity);
    draw(granularity, points);
    if (granularity === "day") await loadSpend(start, end, tenantId);
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
