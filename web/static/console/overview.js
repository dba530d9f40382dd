// Overview: the rates of the last minute and charts of the last quarter hour (from the server's
// live samples), and the engines' state per tenant and per engine, polled.
"use strict";

(() => {
  const intervalMs = 2000;
  const { api, notice, format } = Atrium;

  function cell(text, numeric) {
    const td = document.createElement("td");
    td.textContent = text;
    if (numeric) td.className = "num";
    return td;
  }

  const RANGE_MS = 15 * 60e3;
  const RATE_MS = 60e3;
  const samples = [];
  let lastAt = null;
  const charts = {};

  // The mean of a per-sample rate over the last minute of samples (null: none reported).
  function recent(value) {
    if (!samples.length) return null;
    const end = Date.parse(samples[samples.length - 1].at);
    const values = samples.filter((p) => Date.parse(p.at) > end - RATE_MS).map(value)
      .filter((v) => v !== null && v !== undefined);
    return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
  }

  const refusalsOf = (p) => (p.refusals_per_min === null ? null
    : Object.values(p.refusals_per_min).reduce((a, b) => a + b, 0));
  const tokensOf = (p) => (p.prompt_tokens_per_s === null ? null
    : p.prompt_tokens_per_s + (p.generated_tokens_per_s ?? 0));

  function renderRates(state) {
    samples.push(...state.points);
    if (samples.length) lastAt = samples[samples.length - 1].at;
    const end = lastAt ? Date.parse(lastAt) : Date.now();
    while (samples.length && Date.parse(samples[0].at) < end - RANGE_MS) samples.shift();
    const rps = recent((p) => p.requests_per_s);
    const eps = recent((p) => p.errors_per_s);
    document.getElementById("ov-rps").textContent = format.dec(rps);
    document.getElementById("ov-errors").textContent = eps === null ? "–" : `${format.dec(eps)} /s`;
    document.getElementById("ov-error-rate").textContent =
      rps ? `${format.pct(eps / rps)} of finished requests` : "no requests finished";
    document.getElementById("ov-refusals").textContent = format.dec(recent(refusalsOf));
    document.getElementById("ov-tps").textContent = format.dec(recent(tokensOf));
    const gap = state.interval_s * 3000;
    const { series, line, draw } = Timeline;
    const sets = {
      requests: [line("finished", series(samples, (p) => p.requests_per_s, gap), 0),
        line("errors", series(samples, (p) => p.errors_per_s, gap), 2)],
      tokens: [line("prompt", series(samples, (p) => p.prompt_tokens_per_s, gap), 0),
        line("generated", series(samples, (p) => p.generated_tokens_per_s, gap), 1)],
      refusals: [line("refusals", series(samples, refusalsOf, gap), 2)],
    };
    for (const panel of document.querySelectorAll("[data-overview-chart]")) {
      const kind = panel.dataset.overviewChart;
      const start = samples.length ? Date.parse(samples[0].at) : end - RANGE_MS;
      charts[kind] = draw(panel.querySelector("canvas"), sets[kind], start, end, charts[kind]);
    }
    document.body.dataset.overviewPoints = String(samples.length);
  }

  async function pollRates() {
    const query = lastAt ? `?${new URLSearchParams({ since: lastAt })}` : "";
    try {
      renderRates(await api("GET", `${Atrium.apiRoot}/metrics/live${query}`));
    } catch (error) {
      notice(`Rates unavailable: ${error.message}`);
    }
  }

  function render(state) {
    document.getElementById("ov-engine-tps").textContent = format.dec(state.tokens_per_s);
    document.getElementById("ov-running").textContent = format.int(state.num_running);
    document.getElementById("ov-waiting").textContent = format.int(state.num_waiting);
    const used = state.kv_pages_total - state.kv_pages_free;
    document.getElementById("ov-kv").textContent =
      `${format.int(used)} / ${format.int(state.kv_pages_total)}`;
    document.getElementById("ov-hit").textContent = format.pct(state.hit_rate);
    const body = document.querySelector("#ov-tenants tbody");
    body.replaceChildren();
    for (const t of state.tenants) {
      const row = document.createElement("tr");
      const share = state.kv_pages_total ? t.kv_pages_cached / state.kv_pages_total : null;
      row.append(cell(t.tenant_name || t.tenant_id), cell(format.int(t.running), true),
        cell(format.int(t.waiting), true), cell(format.int(t.kv_pages_cached), true),
        cell(format.pct(share), true), cell(format.pct(t.hit_rate), true));
      body.append(row);
    }
    document.getElementById("ov-empty").hidden = state.tenants.length > 0;
    const engines = document.querySelector("#ov-engines tbody");
    engines.replaceChildren();
    for (const e of state.engines || []) {
      const row = document.createElement("tr");
      row.append(cell(e.url), cell(e.healthy ? "up" : "unreachable"),
        cell(format.dec(e.tokens_per_s), true), cell(format.int(e.num_running), true),
        cell(format.int(e.num_waiting), true),
        cell(`${format.int(e.kv_pages_total - e.kv_pages_free)} / ${format.int(e.kv_pages_total)}`, true),
        cell(format.pct(e.hit_rate), true));
      engines.append(row);
    }
    document.getElementById("ov-updated").textContent = new Date().toLocaleTimeString();
  }

  async function poll() {
    try {
      render(await api("GET", `${Atrium.apiRoot}/engine`));
      notice("");
    } catch (error) {
      notice(`Engine state unavailable: ${error.message}`);
    }
  }

  document.getElementById("ov-interval").textContent = intervalMs / 1000;
  poll();
  pollRates();
  window.setInterval(poll, intervalMs);
  window.setInterval(pollRates, intervalMs);
})();
