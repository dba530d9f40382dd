// Billing: sets prices and previews an export's manifest before downloading it.
"use strict";

(() => {
  const { api, notice, format, formBody } = Atrium;

  function exportQuery(form) {
    const start = `${form.start.value}T00:00:00Z`;
    const end = `${form.end.value}T00:00:00Z`;
    return new URLSearchParams({ start, end, format: form.format.value });
  }

  async function preview(event) {
    event?.preventDefault();
    const form = document.getElementById("export-form");
    const query = exportQuery(form);
    document.getElementById("export-download").href = `${Atrium.apiRoot}/billing/export?${query}`;
    try {
      const manifest = await api("GET", `${Atrium.apiRoot}/billing/manifest?${query}`);
      const costs = Object.entries(manifest.cost_micros)
        .map(([currency, micros]) => format.money(micros, currency));
      const values = {
        rows: format.int(manifest.rows),
        requests: format.int(manifest.requests),
        prompt_tokens: format.int(manifest.prompt_tokens),
        cached_tokens: format.int(manifest.cached_tokens),
        completion_tokens: format.int(manifest.completion_tokens),
        cost: costs.length ? costs.join(" + ") : format.money(0, "USD"),
        sha256: manifest.sha256,
      };
      for (const [name, text] of Object.entries(values)) {
        document.querySelector(`#export-totals [data-total="${name}"]`).textContent = text;
      }
      document.getElementById("export-totals").hidden = false;
      notice("");
    } catch (error) {
      notice(`Export unavailable: ${error.message}`);
    }
  }

  async function setPrice(event) {
    event.preventDefault();
    const body = formBody(event.target);
    const model = body.model;
    delete body.model;
    try {
      await api("PUT", `${Atrium.apiRoot}/prices/${encodeURIComponent(model)}`, body);
      window.location.reload();
    } catch (error) {
      notice(error.message);
    }
  }

  const exportForm = document.getElementById("export-form");
  exportForm.addEventListener("submit", preview);
  exportForm.addEventListener("change", () => preview());
  document.getElementById("price-form").addEventListener("submit", setPrice);
  preview();
})();
