// The page: tabs, the API key field, the error banner and the status panel; chat.js and
// playground.js do the rest.

import { apiKey, describe, getJSON, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Playground } from "./playground.js";
import { $, clearError, showError } from "./ui.js";

const STATUS_EVERY_MS = 3000;

function fmtThreads(t) {
  const model = t.model === null ? t.torch : t.model;
  return `${model} model thread${model === 1 ? "" : "s"}, ${t.controllers} for controllers`;
}

function renderStatus(s) {
  const usage = Math.round(100 * s.kv.usage);
  $("status").innerHTML = "";
  const parts = [
    ["model", `${s.model}`], ["dtype", s.dtype], ["threads", fmtThreads(s.threads)],
    ["KV", `${usage}% of ${s.kv.blocks_total * s.kv.block_size} tokens`],
    ["requests", `${s.running} running, ${s.queued} queued`],
    ["you", `${s.tenant} (${s.role})`],
  ];
  for (const [name, value] of parts) {
    const item = document.createElement("span");
    item.className = "item";
    item.dataset.name = name;
    const label = document.createElement("b");
    label.textContent = name;
    item.append(label, " ", value);
    if (name === "KV") {
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.innerHTML = `<span style="width:${usage}%"></span>`;
      item.append(bar);
    }
    $("status").append(item);
  }
}

const listeners = [];
let last = null;

// Calls `fn(status)` with every new status (and at once if there is one).
export function onStatus(fn) {
  listeners.push(fn);
  if (last) fn(last);
}

async function refreshStatus() {
  try {
    const s = await getJSON("/v1/status");
    const changed = !last || last.tenant !== s.tenant;
    last = s;
    renderStatus(s);
    clearError("status");
    if (changed) listeners.forEach((fn) => fn(s));
  } catch (e) {
    last = null;
    $("status").textContent = e.status === 401 ? "no access: see the message below" : "server unreachable";
    showError(describe(e), "status");
  }
}

function setUpTabs() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      for (const other of document.querySelectorAll(".tab")) {
        other.classList.toggle("active", other === tab);
        $(other.dataset.panel).hidden = other !== tab;
      }
      location.hash = tab.dataset.panel;
    });
  }
  const wanted = document.querySelector(`.tab[data-panel="${location.hash.slice(1)}"]`);
  if (wanted) wanted.click();
}

function setUpKey() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("api-key").value.trim());
    last = null;
    refreshStatus();
  });
}

setUpTabs();
setUpKey();
new Chat();
new Playground(onStatus);
refreshStatus();
setInterval(() => { if (!document.hidden) refreshStatus(); }, STATUS_EVERY_MS);
