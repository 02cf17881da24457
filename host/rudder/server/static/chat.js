// The chat tab: a conversation over /v1/chat/completions, streamed, with stop and regenerate,
// sampling settings and a structured-output picker whose result is shown parsed.

import { describe, stream } from "./api.js";
import { GRAMMAR, SCHEMAS, TOOLS } from "./examples.js";
import { $, clearError, el, showError } from "./ui.js";

// A field's number, or undefined when it is empty.
function number(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

// An editor's JSON, or an Error naming the editor.
function parsed(id, what) {
  try {
    return JSON.parse($(id).value);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
}

export class Chat {
  constructor() {
    this.messages = []; // {role, content, tool_calls?, node}
    this.abort = null;
    for (const name of Object.keys(SCHEMAS)) $("json-example").append(new Option(name, name));
    $("json-example").addEventListener("change", () => this.example());
    this.example();
    $("grammar").value = GRAMMAR;
    $("tools").value = JSON.stringify(TOOLS, null, 2);
    $("so-mode").addEventListener("change", () => this.showMode());
    this.showMode();
    for (const [id, what] of [["json-schema", "The schema"], ["tools", "The tools"]]) {
      $(id).addEventListener("input", () => this.check(id, what));
    }
    $("chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("chat-input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.send();
      }
    });
    $("chat-stop").addEventListener("click", () => this.abort && this.abort.abort());
    $("chat-regenerate").addEventListener("click", () => this.regenerate());
    $("chat-clear").addEventListener("click", () => {
      this.messages = [];
      $("messages").innerHTML = "";
      this.buttons();
    });
  }

  example() {
    $("json-schema").value = JSON.stringify(SCHEMAS[$("json-example").value], null, 2);
    this.check("json-schema", "The schema");
  }

  check(id, what) {
    const hint = $(`${id}-check`);
    try {
      parsed(id, what);
      hint.textContent = "valid JSON";
      hint.className = "hint ok";
    } catch (e) {
      hint.textContent = e.message;
      hint.className = "hint bad";
    }
  }

  showMode() {
    const mode = $("so-mode").value;
    for (const box of document.querySelectorAll(".so")) box.hidden = box.dataset.mode !== mode;
  }

  // The request body: the conversation, the sampling settings and the chosen constraint.
  request() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of this.messages) {
      const out = { role: m.role, content: m.content };
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
    const body = {
      messages, stream: true, temperature: number("temperature"), top_p: number("top_p"),
      max_tokens: number("max_tokens"), seed: number("seed"),
    };
    if (number("top_k")) body.top_k = number("top_k");
    const mode = $("so-mode").value;
    if (mode === "json") {
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed("json-schema", "The schema") } };
    } else if (mode === "regex") {
      body.structured_outputs = { regex: $("regex").value };
    } else if (mode === "choice") {
      const choices = $("choices").value.split("\n").map((c) => c.trim()).filter(Boolean);
      if (!choices.length) throw new Error("Give at least one choice");
      body.structured_outputs = { choice: choices };
    } else if (mode === "grammar") {
      body.structured_outputs = { grammar: $("grammar").value };
    } else if (mode === "tools") {
      body.tools = parsed("tools", "The tools");
      body.tool_choice = $("tool-choice").value;
    }
    return { body, mode };
  }

  buttons() {
    const busy = this.abort !== null;
    $("chat-send").disabled = busy;
    $("chat-stop").disabled = !busy;
    const last = this.messages[this.messages.length - 1];
    $("chat-regenerate").disabled = busy || !last || last.role !== "assistant";
  }

  render(message) {
    const node = el("div", `message ${message.role}`);
    node.append(el("div", "role", message.role), el("div", "content", message.content));
    $("messages").append(node);
    node.scrollIntoView({ block: "end" });
    message.node = node;
    return node;
  }

  send() {
    const text = $("chat-input").value.trim();
    if (!text || this.abort) return;
    $("chat-input").value = "";
    const message = { role: "user", content: text };
    this.messages.push(message);
    this.render(message);
    this.answer();
  }

  regenerate() {
    const last = this.messages[this.messages.length - 1];
    if (this.abort || !last || last.role !== "assistant") return;
    this.messages.pop();
    last.node.remove();
    this.answer();
  }

  async answer() {
    let request;
    try {
      request = this.request();
    } catch (e) {
      showError(e.message, "chat");
      return;
    }
    clearError("chat");
    const message = { role: "assistant", content: "", tool_calls: [] };
    this.messages.push(message);
    const node = this.render(message);
    node.classList.add("streaming");
    node.dataset.chunks = "0";
    const content = node.querySelector(".content");
    const thinking = el("div", "thinking");
    node.insertBefore(thinking, content);
    this.abort = new AbortController();
    this.buttons();
    let finish = null;
    try {
      for await (const chunk of stream("/v1/chat/completions", request.body, this.abort.signal)) {
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content) thinking.textContent += delta.reasoning_content;
        if (delta.content) {
          message.content += delta.content;
          content.textContent = message.content;
          node.dataset.chunks = String(Number(node.dataset.chunks) + 1);
        }
        for (const call of delta.tool_calls || []) {
          const known = message.tool_calls[call.index] ||
            (message.tool_calls[call.index] = { id: call.id, type: "function", function: { name: "", arguments: "" } });
          if (call.function && call.function.name) known.function.name = call.function.name;
          if (call.function && call.function.arguments) known.function.arguments += call.function.arguments;
          node.dataset.chunks = String(Number(node.dataset.chunks) + 1);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        node.scrollIntoView({ block: "end" });
      }
      node.append(el("div", "finish", finish ? `finish: ${finish}` : ""));
      this.showParsed(message, request.mode, finish);
    } catch (e) {
      const stopped = e.name === "AbortError";
      node.append(el("div", stopped ? "finish" : "finish bad", stopped ? "stopped" : describe(e)));
      if (!stopped) showError(describe(e), "chat");
    } finally {
      node.classList.remove("streaming");
      node.classList.add("done");
      this.abort = null;
      this.buttons();
    }
  }

  // The answer as data: pretty JSON for a JSON Schema, a card per tool call.
  showParsed(message, mode, finish) {
    const node = message.node;
    if (mode === "json") {
      const box = el("div", "parsed");
      try {
        const value = JSON.parse(message.content);
        box.append(el("div", "label ok", "parsed JSON"), el("pre", "", JSON.stringify(value, null, 2)));
      } catch (e) {
        box.append(el("div", "label bad", `not a whole JSON document (${finish === "length" ? "max tokens reached" : e.message})`));
      }
      node.append(box);
    }
    if (message.tool_calls.length) {
      if (!message.content) node.querySelector(".content").remove();
      for (const call of message.tool_calls) {
        const card = el("div", "tool-card");
        card.append(el("div", "name", `${call.function.name}()`));
        let args = call.function.arguments;
        try {
          args = JSON.stringify(JSON.parse(args), null, 2);
        } catch (_) { /* shown as sent */ }
        card.append(el("pre", "", args), el("div", "id", call.id || ""));
        node.append(card);
      }
    }
  }
}
