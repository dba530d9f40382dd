// Atrium console: fetch helper (session cookie + CSRF header), number formats, API-backed forms.
"use strict";

const Atrium = (() => {
  const csrf = document.querySelector('meta[name="csrf-token"]')?.content ?? "";
  const intFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const decFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 2 });

  async function api(method, url, body) {
    const init = { method, credentials: "same-origin", headers: { "X-CSRF-Token": csrf } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(url, init);
    if (response.status === 401) {
      window.location.assign(document.body.dataset.root || "/admin/");
      throw new Error("Your session has ended; sign in again.");
    }
    const text = await response.text();
    const data = text ? JSON.parse(text) : null;
    if (!response.ok) {
      const message = data?.error?.message ?? `Request failed (${response.status})`;
      throw new Error(message);
    }
    return data;
  }

  function notice(message, kind = "error") {
    const box = document.getElementById("notice");
    if (!box) return;
    box.textContent = message;
    box.className = `notice ${kind}`;
    box.hidden = !message;
  }

  const format = {
    int: (n) => (n === null || n === undefined ? "–" : intFmt.format(n)),
    dec: (n) => (n === null || n === undefined ? "–" : decFmt.format(n)),
    pct: (x) => (x === null || x === undefined ? "–" : `${decFmt.format(x * 100)} %`),
    money: (micros, currency) =>
      new Intl.NumberFormat("en-US", { style: "currency", currency: currency || "USD",
        maximumFractionDigits: 6 }).format(micros / 1e6),
  };

  // A form with data-api sends its fields as JSON to the admin API.
  function formBody(form) {
    const body = {};
    for (const input of form.querySelectorAll("input[name], select[name], textarea[name]")) {
      let value = input.value.trim();
      const type = input.dataset.type;
      if (input.type === "checkbox") {
        // Checkboxes of one name make a list of the checked values (an empty one included).
        const list = (body[input.name] ??= []);
        if (input.checked) list.push(input.value);
        continue;
      }
      if (type === "number") value = value === "" ? null : Number(value);
      else if (type === "money-or-null") value = value === "" ? null : Math.round(Number(value) * 1e6);
      else if (type === "utc") value = value === "" ? null : `${value.length === 16 ? `${value}:00` : value}Z`;
      else if (type === "hours") value = Math.round(Number(value) * 3600);
      else if (type === "money") value = Math.round(Number(value) * 1e6);
      else if (type === "list") value = value.trim() === "" ? null : value.split(",").map((v) => v.trim()).filter(Boolean);
      else if (value === "" && input.tagName === "INPUT") continue;
      const path = input.name.split(".");
      let target = body;
      for (const part of path.slice(0, -1)) target = target[part] ??= {};
      target[path[path.length - 1]] = value;
    }
    if (body.weight === null) delete body.weight;
    return body;
  }

  // Re-render one server-rendered section in place, from a fresh copy of this page.
  async function refreshSection(id) {
    const response = await fetch(window.location.href, { credentials: "same-origin" });
    if (!response.ok) return;
    const html = await response.text();
    const fresh = new DOMParser().parseFromString(html, "text/html").getElementById(id);
    if (fresh) document.getElementById(id)?.replaceWith(fresh);
  }

  async function submitApiForm(event) {
    const form = event.target;
    if (!form.dataset.api) return;
    event.preventDefault();
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
    const method = form.dataset.method || "POST";
    try {
      const data = await api(method, form.dataset.api, method === "DELETE" ? undefined : formBody(form));
      if (form.dataset.done === "secret") {
        document.getElementById("secret-value").textContent = data.key;
        const note = document.getElementById("secret-note");
        if (note) {
          note.textContent = data.replaces
            ? `It replaces key ${data.replaces}, which works until ${data.replaces_until ?? "now"}.` : "";
          note.hidden = !data.replaces;
        }
        document.getElementById("secret-box").hidden = false;
        form.closest("dialog")?.close();
        document.getElementById("secret-box").scrollIntoView({ block: "center" });
        if (!form.closest("dialog")) form.hidden = true;
        notice("");
        if (form.dataset.refresh) await refreshSection(form.dataset.refresh);
      } else {
        window.location.reload();
      }
    } catch (error) {
      const dialog = form.closest("dialog");
      if (!dialog) {
        notice(error.message);
        return;
      }
      // The page's notice is behind the open dialog: say it in the dialog.
      let box = dialog.querySelector(".dialog-notice");
      if (!box) {
        box = document.createElement("div");
        box.className = "dialog-notice notice error";
        box.setAttribute("role", "alert");
        dialog.prepend(box);
      }
      box.textContent = error.message;
    }
  }

  // Buttons with data-open show the dialog they name; data-close shuts the one they are in.
  document.addEventListener("click", (event) => {
    const opener = event.target.closest("[data-open]");
    if (opener) {
      document.getElementById(opener.dataset.open)?.showModal();
      return;
    }
    if (event.target.closest("[data-close]")) event.target.closest("dialog")?.close();
  });

  document.addEventListener("submit", submitApiForm);
  return { api, notice, format, formBody, apiRoot: "/admin/v1" };
})();
