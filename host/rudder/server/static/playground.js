// The controller playground: pick a built-in controller, one of your tags or uploads (or
// upload a .wasm), edit its argument, run it on /v1/run with "trace": true, and watch the
// trace (trace_view.js). The run exports as JSON.

import { describe, getJSON, postBytes, stream } from "./api.js";
import { BUILTIN } from "./examples.js";
import { TraceView } from "./trace_view.js";
import { $, clearError, download, showError } from "./ui.js";

const number = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));

export class Playground {
  constructor(onStatus) {
    this.view = new TraceView($("pg-columns"), $("pg-strip"), $("pg-detail"));
    this.abort = null;
    this.run = null; // the last run: request, trace events, done
    this.status = null;
    this.lastExample = null;
    onStatus((status) => {
      this.status = status;
      this.view.vocab = status.vocab_size;
      $("pg-upload").disabled = status.restricted;
      this.refresh();
    });
    $("pg-controller").addEventListener("change", () => this.example());
    $("pg-upload").addEventListener("change", () => this.upload());
    $("pg-run").addEventListener("click", () => this.start());
    $("pg-stop").addEventListener("click", () => this.abort && this.abort.abort());
    $("pg-export").addEventListener("click", () => download("rudder-trace.json", this.run));
  }

  // The controllers this key may pick: the built-ins, its tenant's tags and its uploads.
  async refresh(select = null) {
    const picker = $("pg-controller");
    const keep = select || picker.value;
    try {
      const [tags, modules] = await Promise.all([getJSON("/v1/controllers/tags"), getJSON("/v1/controllers")]);
      const tenant = this.status.tenant;
      picker.innerHTML = "";
      const group = (label) => picker.appendChild(Object.assign(document.createElement("optgroup"), { label }));
      const builtin = group("Built-in");
      for (const name of tags.builtin) builtin.append(new Option(name, name));
      const own = tags.tags.filter((t) => !t.builtin && t.owner === tenant);
      const ownNames = new Set(own.map((t) => t.tag));
      if (own.length) {
        const g = group(`Tags of ${tenant}`);
        for (const t of own) g.append(new Option(t.tag, t.tag));
      }
      const uploads = modules.data.filter((m) => !m.builtin && m.uploaded_by.includes(tenant));
      if (uploads.length) {
        const g = group(`Uploads of ${tenant}`);
        for (const m of uploads) {
          const names = m.tags.filter((t) => ownNames.has(t)); // another tenant's tag names stay theirs
          g.append(new Option(`${m.module_id.slice(0, 12)}…${names.length ? ` (${names.join(", ")})` : ""}`, m.module_id));
        }
      }
      picker.value = [...picker.options].some((o) => o.value === keep) ? keep : "fork";
      clearError("playground");
      this.example();
    } catch (e) {
      showError(describe(e), "playground");
    }
  }

  // A built-in's example argument and prompt, unless the person has edited them.
  example() {
    const name = $("pg-controller").value;
    const ex = BUILTIN[name];
    const last = this.lastExample;
    if (!last || ($("pg-arg").value === last.arg && $("pg-prompt").value === last.prompt)) {
      $("pg-arg").value = ex ? ex.arg : "";
      $("pg-prompt").value = ex ? ex.prompt : $("pg-prompt").value;
      this.lastExample = { arg: $("pg-arg").value, prompt: $("pg-prompt").value };
    }
  }

  async upload() {
    const file = $("pg-upload").files[0];
    if (!file) return;
    $("pg-summary").textContent = `uploading ${file.name} (${file.size} bytes)…`;
    try {
      const info = await postBytes("/v1/controllers", await file.arrayBuffer());
      $("pg-summary").textContent = `uploaded ${file.name}: module ${info.module_id.slice(0, 12)}…, compiled in ${info.time_ms} ms`;
      await this.refresh(info.module_id);
    } catch (e) {
      $("pg-summary").textContent = "";
      showError(`The upload failed: ${describe(e)}`, "playground");
    } finally {
      $("pg-upload").value = "";
    }
  }

  request() {
    const prompt = $("pg-prompt").value;
    const body = {
      controller: $("pg-controller").value, controller_arg: $("pg-arg").value, trace: true, stream: true,
      max_tokens: number("pg-max-tokens"), temperature: number("pg-temperature"), seed: number("pg-seed"),
    };
    if ($("pg-chat").checked) body.messages = [{ role: "user", content: prompt }];
    else body.prompt = prompt;
    return body;
  }

  buttons() {
    $("pg-run").disabled = this.abort !== null;
    $("pg-stop").disabled = this.abort === null;
    $("pg-export").disabled = this.abort !== null || this.run === null;
  }

  async start() {
    if (this.abort) return;
    const body = this.request();
    this.view.reset();
    $("pg-log").textContent = "";
    $("pg-summary").textContent = `running ${body.controller}…`;
    $("pg-summary").className = "summary running";
    clearError("playground");
    this.run = { request: body, model: this.status && this.status.model, trace: [], done: null, log: "" };
    this.abort = new AbortController();
    this.buttons();
    try {
      for await (const event of stream("/v1/run", body, this.abort.signal)) {
        if (event.type === "trace") {
          this.run.trace.push(event);
          this.view.add(event);
        } else if (event.type === "step") {
          this.view.deltas(event.deltas);
          if (event.log) {
            this.run.log += event.log;
            $("pg-log").textContent = this.run.log;
          }
        } else if (event.type === "done") {
          this.run.done = event;
          this.finished(event);
        }
      }
    } catch (e) {
      const stopped = e.name === "AbortError";
      $("pg-summary").textContent = stopped ? "stopped" : describe(e);
      $("pg-summary").className = stopped ? "summary" : "summary bad";
      if (!stopped) showError(describe(e), "playground");
    } finally {
      this.abort = null;
      this.buttons();
    }
  }

  finished(done) {
    const u = done.usage;
    const t = done.timings;
    const parts = [
      `${done.choices.length} sequence${done.choices.length > 1 ? "s" : ""}`,
      `${u.completion_tokens} tokens (${u.sampled_tokens} sampled, ${u.ff_tokens} forced)`,
      `${this.run.trace.length} steps traced`,
      `controller ${t.controller_ms} ms, model ${t.forward_ms} ms, total ${t.total_ms} ms`,
    ];
    const summary = $("pg-summary");
    summary.textContent = parts.join(" · ");
    summary.className = "summary done";
  }
}
