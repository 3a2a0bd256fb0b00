// Web UI of the sequential translation server: translate as you type,
// reading the server's SSE stream with fetch, and switch models with a
// progress dialog. Plain JavaScript, no build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const input = $("input");
const output = $("output");
const langSelect = $("target-lang");
const modelSelect = $("model");
const dialog = $("progress-dialog");
const progressBar = $("progress-bar");
const progressStatus = $("progress-status");
const closeButton = $("progress-close");

const DEBOUNCE_MS = 300;
let timer = null;        // pending debounced translation
let controller = null;   // AbortController of the translation in flight
let currentModel = "";   // the model the server has loaded (restored on error)
let switching = false;   // a model download/load is running

// Output text plus a data-state ("idle", "streaming", "done", "error") for tests and CSS.
function setOutput(text, state) {
  output.textContent = text;
  output.dataset.state = state;
}

// Yield the data of each server-sent event in a fetch response.
// Events are "data: ..." lines ended by a blank line. A network read can end
// anywhere (mid-line, even mid-character), so bytes are decoded in streaming
// mode and text is buffered until a complete event has arrived.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return; // an unterminated last event is dropped, as the SSE spec says
      buffer += decoder.decode(value, { stream: true });
      buffer = buffer.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        const data = lines
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data; // comment lines (": ...") and empty events are skipped
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // stop the download if the caller stopped early
  }
}

// The message of a non-200 answer: its JSON {"error": ...} if it has one.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}

// POST a JSON body and return the response; non-200 answers become errors.
async function postJSON(url, body, signal) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

// Translate the input now, replacing any translation still in flight.
async function translate() {
  clearTimeout(timer);
  if (controller) controller.abort();
  controller = null;
  const text = input.value;
  if (!text.trim()) return setOutput("", "idle"); // nothing to send
  const ctrl = (controller = new AbortController());
  setOutput("", "streaming");
  try {
    const response = await postJSON("/translate/stream", { text, target_lang: langSelect.value }, ctrl.signal);
    for await (const data of sseEvents(response)) {
      if (ctrl.signal.aborted) return; // a newer request owns the output now
      if (data === "[DONE]") return setOutput(output.textContent, "done");
      const token = JSON.parse(data);
      if (typeof token === "string") output.textContent += token;
      else if (token && token.error) throw new Error(token.error);
    }
    throw new Error("the stream ended before [DONE]");
  } catch (err) {
    if (!ctrl.signal.aborted) setOutput(`Error: ${err.message}`, "error");
  } finally {
    if (controller === ctrl) controller = null;
  }
}

// Translate DEBOUNCE_MS after the last keystroke or language change.
function scheduleTranslate() {
  clearTimeout(timer);
  if (!input.value.trim()) return translate(); // cleared: empty the output at once
  timer = setTimeout(translate, DEBOUNCE_MS);
}

// Fill the model menu from GET /models: "name (params)", marked when not downloaded.
async function loadModels() {
  const response = await fetch("/models");
  if (!response.ok) throw new Error(await errorMessage(response));
  const { models } = await response.json();
  modelSelect.replaceChildren(
    ...models.map((m) => {
      const label = `${m.name} (${m.params})` + (m.downloaded ? "" : " ⬇");
      const option = new Option(label, m.name, m.selected, m.selected);
      const size = typeof m.size === "number" ? `${Math.round(m.size / 1e6)} MB` : m.size;
      option.title = m.downloaded ? size : `not downloaded yet (${size})`;
      return option;
    })
  );
  currentModel = modelSelect.value;
}

// Show the modal progress dialog: percent is a number, or null for "busy".
function showProgress(message, percent) {
  progressStatus.textContent = message;
  if (percent === null) progressBar.removeAttribute("value"); // indeterminate bar
  else progressBar.value = percent;
  if (!dialog.open) dialog.showModal();
}

// Switch model: POST /models/select and follow its SSE status events.
async function selectModel() {
  const name = modelSelect.value;
  switching = true;
  modelSelect.disabled = true;
  closeButton.hidden = true;
  showProgress(`Preparing ${name}…`, null);
  try {
    const response = await postJSON("/models/select", { model: name });
    let ready = false;
    for await (const data of sseEvents(response)) {
      const event = JSON.parse(data);
      if (event.status === "downloading") showProgress(`Downloading ${name}… ${event.progress}%`, event.progress);
      else if (event.status === "loading") showProgress(`Loading ${name}…`, null);
      else if (event.status === "error") throw new Error(event.message);
      else if (event.status === "ready") { ready = true; break; }
    }
    if (!ready) throw new Error("the connection closed before the model was ready");
    dialog.close();
    await loadModels(); // "downloaded" and "selected" have changed
    translate();
  } catch (err) {
    progressStatus.textContent = `Error: ${err.message}`;
    closeButton.hidden = false;
    modelSelect.value = currentModel; // back to the model that is still loaded
  } finally {
    switching = false;
    modelSelect.disabled = false;
  }
}

input.addEventListener("input", scheduleTranslate);
langSelect.addEventListener("change", scheduleTranslate);
modelSelect.addEventListener("change", selectModel);
// Escape must not hide the dialog while a download is running.
dialog.addEventListener("cancel", (event) => { if (switching) event.preventDefault(); });

loadModels().catch((err) => {
  modelSelect.replaceChildren(new Option(`unavailable: ${err.message}`, ""));
});
if (input.value.trim()) translate(); // text restored by the browser on reload
