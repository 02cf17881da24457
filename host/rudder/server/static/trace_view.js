// A traced run, drawn as it streams: a column of token chips per sequence (forks side by
// side), coloured by how each token came; a strip of per-step controller time and mask size;
// and the details of the step under the pointer.

import { el } from "./ui.js";

const STRIP_PX = 29; // each half of a strip tick

// A token's text as a chip shows it (whitespace visible, never empty).
function shown(text) {
  if (text === undefined) return "?";
  const visible = text.replace(/\n/g, "↵").replace(/\t/g, "⇥");
  return visible === "" ? "∅" : visible;
}

const pct = (logprob) => `${(100 * Math.exp(logprob)).toFixed(logprob > -4.6 ? 1 : 3)}%`;

function how(e, kind) {
  if (kind === "forced") return "forced by fast-forward";
  if (kind === "stop") return "the controller stopped the sequence";
  if (kind === "none") return "the mask allowed no token";
  return e.allowed === null ? "sampled freely" : "sampled under a mask";
}

export class TraceView {
  constructor(columns, strip, detail) {
    this.columnsNode = columns;
    this.stripNode = strip;
    this.detailNode = detail;
    this.vocab = null;
    this.reset();
  }

  reset() {
    this.columns = new Map(); // seq -> {node, chips, text, last}
    this.events = [];
    this.scale = 0.05; // ms of the strip's full height
    this.columnsNode.innerHTML = "";
    this.stripNode.innerHTML = "";
    this.detailNode.textContent = "Hover a token to see its step.";
  }

  column(seq, parent = null, step = null) {
    let col = this.columns.get(seq);
    if (col) return col;
    const node = el("div", "column");
    node.dataset.seq = seq;
    const head = el("div", "column-head", parent === null ? `sequence ${seq}` : `sequence ${seq} · forked from ${parent} at step ${step}`);
    const chips = el("div", "chips");
    const text = el("pre", "text");
    node.append(head, chips, text);
    col = { node, head, chipsNode: chips, textNode: text, chips: [], text: "", last: null };
    this.columns.set(seq, col);
    const after = [...this.columns.keys()].filter((s) => s > seq);
    this.columnsNode.insertBefore(node, after.length ? this.columns.get(Math.min(...after)).node : null);
    return col;
  }

  // A fork begins with its parent's chips as they were before the step that forked it.
  forkFrom(parent, child, e) {
    const from = this.column(parent);
    const col = this.column(child, parent, e.step);
    let records = from.chips;
    if (from.last && from.last.step === e.step) {
      const undo = new Set(from.last.struck);
      records = records.slice(0, records.length - from.last.added)
        .map((r) => ({ ...r, takenBack: undo.has(r) ? null : r.takenBack }));
    }
    for (const r of records) this.chip(col, r.event, r.id, r.kind, { inherited: true, takenBack: r.takenBack });
    col.text = from.text;
    return col;
  }

  chip(col, e, id, kind, { inherited = false, takenBack = null } = {}) {
    const text = id === null ? (kind === "stop" ? "■ stop" : "∅ none allowed") : shown(e.text[String(id)]);
    const node = el("span", `chip ${kind}`, text);
    if (inherited) node.classList.add("inherited");
    const record = { id, kind, event: e, node, takenBack, marker: id === null };
    if (takenBack) node.classList.add("taken-back");
    node.title = this.summary(record);
    node.addEventListener("mouseenter", () => this.detail(record));
    col.chipsNode.append(node);
    col.chips.push(record);
    return record;
  }

  // One trace event (docs/server.md, "Trace events").
  add(e) {
    this.events.push(e);
    const col = e.parent !== null && !this.columns.has(e.seq) ? this.forkFrom(e.parent, e.seq, e) : this.column(e.seq);
    const last = { step: e.step, added: 0, struck: [] };
    if (e.backtrack) {
      let left = e.backtrack;
      for (let i = col.chips.length - 1; i >= 0 && left > 0; i--) {
        const r = col.chips[i];
        if (r.takenBack || r.marker) continue;
        r.takenBack = e;
        r.node.classList.add("taken-back");
        r.node.title = this.summary(r);
        last.struck.push(r);
        left--;
      }
    }
    const before = col.chips.length;
    if (e.stop) {
      this.chip(col, e, null, "stop");
    } else if (e.token === null && e.ff.length === 1) {
      for (const id of e.ff[0]) this.chip(col, e, id, "forced");
    } else if (e.token !== null && e.token < 0) {
      this.chip(col, e, null, "none");
    } else if (e.token !== null) {
      this.chip(col, e, e.token, e.allowed === null ? "free" : "masked");
      const list = e.ff.find((l) => l[0] === e.token);
      if (list) for (const id of list.slice(1)) this.chip(col, e, id, "forced");
    }
    last.added = col.chips.length - before;
    col.last = last;
    this.tick(e);
  }

  // A step event's deltas: the text of each sequence (backtracked characters deleted first).
  deltas(deltas) {
    for (const d of deltas) {
      const col = this.columns.get(d.branch) || this.column(d.branch);
      if (d.backtrack) col.text = col.text.slice(0, col.text.length - d.backtrack);
      col.text += d.text;
      col.textNode.textContent = col.text;
      if (d.finish_reason) {
        col.head.append(el("span", `badge ${d.finish_reason}`, d.finish_reason));
        col.node.dataset.finish = d.finish_reason;
      }
    }
  }

  tick(e) {
    if (e.controller_ms > this.scale) {
      while (this.scale < e.controller_ms) this.scale *= 2;
      for (const node of this.stripNode.children) this.size(node);
    }
    const node = el("div", "tick");
    node.dataset.ms = e.controller_ms;
    node.dataset.allowed = e.allowed === null ? "" : e.allowed;
    node.append(el("span", "time"), el("span", `mask${e.allowed === null ? " none" : ""}`));
    node.title = `step ${e.step} · seq ${e.seq}: controller ${e.controller_ms} ms, ` +
      (e.allowed === null ? "no mask" : `mask allows ${e.allowed}${this.vocab ? ` of ${this.vocab}` : ""}`);
    node.addEventListener("mouseenter", () => this.detail({ event: e, kind: e.stop ? "stop" : e.token === null ? "forced" : e.allowed === null ? "free" : "masked", id: e.token }));
    this.size(node);
    this.stripNode.append(node);
  }

  size(node) {
    const ms = Number(node.dataset.ms);
    node.firstChild.style.height = `${Math.max(1, Math.round(STRIP_PX * ms / this.scale))}px`;
    const allowed = node.dataset.allowed;
    const vocab = this.vocab || 65536;
    const share = allowed === "" ? 0 : Math.log(Number(allowed) + 1) / Math.log(vocab + 1);
    node.lastChild.style.height = `${allowed === "" ? 0 : Math.max(1, Math.round(STRIP_PX * share))}px`;
  }

  summary(r) {
    const e = r.event;
    const lines = [`step ${e.step} · sequence ${e.seq}: ${how(e, r.kind)}`];
    if (e.allowed !== null && r.kind !== "forced") lines.push(`allowed ${e.allowed}${this.vocab ? ` of ${this.vocab}` : ""} tokens`);
    if (r.kind !== "forced" && e.logprob !== null && r.id === e.token) {
      lines.push(`p = ${pct(e.logprob)}`);
      for (const [id, lp] of e.top) lines.push(`  ${JSON.stringify(e.text[String(id)])} ${pct(lp)}`);
    }
    lines.push(`controller ${e.controller_ms} ms`);
    if (r.takenBack) lines.push(`taken back at step ${r.takenBack.step}`);
    return lines.join("\n");
  }

  detail(r) {
    const e = r.event;
    const box = this.detailNode;
    box.innerHTML = "";
    box.append(el("h3", "", `step ${e.step} · sequence ${e.seq}${e.fork ? ` (fork ${e.fork})` : ""}`));
    box.append(el("div", `how ${r.kind}`, how(e, r.kind)));
    if (r.takenBack) box.append(el("div", "struck", `taken back by the backtrack at step ${r.takenBack.step}`));
    if (e.backtrack) box.append(el("div", "", `this step first took back ${e.backtrack} token${e.backtrack > 1 ? "s" : ""}`));
    if (e.allowed !== null) {
      const first = e.first_allowed.map((id) => JSON.stringify(e.text[String(id)])).join(", ");
      box.append(el("div", "", `mask: allowed ${e.allowed}${this.vocab ? ` of ${this.vocab}` : ""}; first: ${first}${e.allowed > e.first_allowed.length ? ", …" : ""}`));
    }
    if (e.ff.length && e.ff[0].length) {
      const lists = e.ff.map((l) => JSON.stringify(l.map((id) => e.text[String(id)]).join(""))).join(" | ");
      box.append(el("div", "", `fast-forward list${e.ff.length > 1 ? "s" : ""}: ${lists}`));
    }
    if (e.token !== null && e.token >= 0 && e.logprob !== null) {
      box.append(el("div", "", `sampled ${JSON.stringify(e.text[String(e.token)])}, p = ${pct(e.logprob)}`));
      const table = el("table", "top");
      for (const [id, lp] of e.top) {
        const row = el("tr", id === e.token ? "chosen" : "");
        const bar = el("td", "bar");
        bar.append(el("span"));
        bar.firstChild.style.width = `${Math.round(100 * Math.exp(lp))}%`;
        row.append(el("td", "tok", JSON.stringify(e.text[String(id)])), el("td", "p", pct(lp)), bar);
        table.append(row);
      }
      box.append(table);
    }
    box.append(el("div", "ms", `controller answered in ${e.controller_ms} ms`));
  }
}
