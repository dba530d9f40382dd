// Overview: polls the engines' live state and redraws the cards, the per-tenant and per-engine tables.
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

  function render(state) {
    document.getElementById("ov-tps").textContent = format.dec(state.tokens_per_s);
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
  window.setInterval(poll, intervalMs);
})();
