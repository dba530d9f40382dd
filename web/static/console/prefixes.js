// Public prefixes: list (optionally with unpublished ones), publish and unpublish through the admin API.
"use strict";

(() => {
  const { api, notice, format } = Atrium;
  const url = `${Atrium.apiRoot}/public-prefixes`;

  function cell(content, className) {
    const td = document.createElement("td");
    if (content instanceof Node) td.append(content);
    else td.textContent = content;
    if (className) td.className = className;
    return td;
  }

  function when(iso) {
    return iso ? `${iso.slice(0, 16).replace("T", " ")} UTC` : "—";
  }

  function row(prefix) {
    const tr = document.createElement("tr");
    tr.dataset.prefixId = prefix.id;
    const text = document.createElement("pre");
    text.className = "prefix-text";
    text.textContent = prefix.text;
    let status = "published";
    let statusClass = "status-active";
    if (prefix.unpublished_at) {
      status = `unpublished ${when(prefix.unpublished_at)} by ${prefix.unpublished_by}`;
      statusClass = "status-revoked";
    } else if (prefix.engine_error) {
      status = `not held by the engine: ${prefix.engine_error}`;
      statusClass = "status-expired";
    }
    const action = document.createElement("td");
    if (!prefix.unpublished_at) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "danger";
      button.textContent = "Unpublish";
      button.addEventListener("click", () => unpublish(prefix.id));
      action.append(button);
    }
    tr.append(cell(text), cell(`${when(prefix.created_at)} by ${prefix.created_by}`, "nowrap"),
      cell(format.int(prefix.num_tokens), "num"), cell(format.int(prefix.num_cached_tokens), "num"),
      cell(status, statusClass), action);
    return tr;
  }

  async function load() {
    const all = document.getElementById("prefix-show-unpublished").checked;
    try {
      const prefixes = await api("GET", `${url}${all ? "?include_unpublished=true" : ""}`);
      document.querySelector("#prefixes-table tbody").replaceChildren(...prefixes.map(row));
      document.getElementById("prefixes-table").hidden = prefixes.length === 0;
      document.getElementById("prefixes-empty").hidden = prefixes.length > 0;
      document.body.dataset.prefixesLoaded = String(prefixes.length);
    } catch (error) {
      notice(`Public prefixes unavailable: ${error.message}`);
    }
  }

  async function unpublish(id) {
    if (!window.confirm("Unpublish this prefix? Tenants stop sharing its cached pages.")) return;
    try {
      await api("DELETE", `${url}/${encodeURIComponent(id)}`);
      notice("Prefix unpublished.", "ok");
      await load();
    } catch (error) {
      notice(error.message);
    }
  }

  async function publish(event) {
    event.preventDefault();
    const form = event.target;
    try {
      await api("POST", url, { text: form.text.value });
      form.reset();
      notice("Prefix published.", "ok");
      await load();
    } catch (error) {
      notice(error.message);
    }
  }

  document.getElementById("prefix-publish").addEventListener("submit", publish);
  document.getElementById("prefix-show-unpublished").addEventListener("change", load);
  load();
})();
