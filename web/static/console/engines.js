// Engines: one card per engine behind this gateway, with its own numbers and its tenants.
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

  function card(engine) {
    const node = document.getElementById("engine-card").content.firstElementChild.cloneNode(true);
    node.dataset.engineUrl = engine.url;
    node.dataset.healthy = String(engine.healthy);
    const set = (field, text) => { node.querySelector(`[data-field="${field}"]`).textContent = text; };
    set("url", engine.url);
    set("health", engine.healthy ? "up" : "unreachable");
    node.querySelector('[data-field="health"]').className = engine.healthy ? "health-up" : "health-down";
    set("tps", format.dec(engine.tokens_per_s));
    set("requests", `${format.int(engine.num_running)} / ${format.int(engine.num_waiting)}`);
    set("kv", `${format.int(engine.kv_pages_total - engine.kv_pages_free)} / ${format.int(engine.kv_pages_total)}`);
    set("cached", format.int(engine.kv_pages_cached));
    set("hit", format.pct(engine.hit_rate));
    set("preemptions", format.int(engine.num_preemptions));
    set("draft", engine.draft_acceptance === null ? "no drafting" : format.pct(engine.draft_acceptance));
    const body = node.querySelector(".engine-tenants tbody");
    for (const t of engine.tenants) {
      const row = document.createElement("tr");
      row.append(cell(t.tenant_name || t.tenant_id), cell(format.int(t.running), true),
        cell(format.int(t.waiting), true), cell(format.int(t.kv_pages_cached), true),
        cell(format.pct(t.hit_rate), true));
      body.append(row);
    }
    if (!engine.tenants.length) {
      const row = document.createElement("tr");
      const td = cell("No tenant has requests or cached pages here.");
      td.colSpan = 5;
      td.className = "empty";
      row.append(td);
      body.append(row);
    }
    return node;
  }

  async function poll() {
    try {
      const state = await api("GET", `${Atrium.apiRoot}/engine`);
      const engines = state.engines || [];
      document.getElementById("engine-cards").replaceChildren(...engines.map(card));
      document.getElementById("eng-empty").hidden = engines.length > 0;
      const up = engines.filter((e) => e.healthy).length;
      document.getElementById("eng-count").textContent =
        `${format.int(up)} of ${format.int(engines.length)} up.`;
      document.getElementById("eng-updated").textContent = new Date().toLocaleTimeString();
      notice("");
    } catch (error) {
      notice(`Engine state unavailable: ${error.message}`);
    }
  }

  document.getElementById("eng-interval").textContent = intervalMs / 1000;
  poll();
  window.setInterval(poll, intervalMs);
})();
