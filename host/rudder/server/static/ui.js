// Small DOM helpers shared by the page's modules.

export const $ = (id) => document.getElementById(id);

// A new element with a class and text.
export function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

// The banner under the header: one message at a time ("" hides it). `from` names who set it,
// so that only they clear it.
export function showError(message, from = "") {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
  box.dataset.from = message ? from : "";
}

export function clearError(from) {
  if ($("error").dataset.from === from) showError("");
}

// A file download of `data` as pretty JSON.
export function download(name, data) {
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = el("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
