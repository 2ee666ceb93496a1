// The tinylm playground: stream a completion into the prompt box, and chart the next-token
// distribution at the cursor. Plain JavaScript, no libraries, no build step.
//
// The chart needs the model's logits only once per cursor position (POST /next_token returns all
// of them); temperature, top-k and top-p are applied here, in the same order and with the same
// tie rules as tinylm.generate.sampling, so moving a slider redraws at once.
"use strict";

const $ = (id) => document.getElementById(id);
const promptBox = $("prompt");
const statusLine = $("status");
const TOP_P_TOLERANCE = 1e-6; // as in tinylm.generate.sampling: a sum that misses p by rounding still reaches it
const CHART_ROWS = 12;

let modelName = null;
let contextLength = null; // the model's window in tokens: prompt plus completion must fit in it
let current = null; // {logits: Float32Array, top: [{id, token, logit}], text}
let chartRequest = 0; // increases with every request: a late answer for an old cursor is dropped
let streaming = null; // the AbortController of the running completion

// ----- talking to the server ------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error && body.error.message ? body.error.message : response.statusText;
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

// ``source`` says what an error came from ("server": loading the model or the chart, "max-tokens",
// "generate"), so that the success of the same thing can clear it (clearError) and nothing else does.
function setStatus(text, state, source = "") {
  statusLine.textContent = text;
  statusLine.dataset.state = state;
  statusLine.dataset.source = source;
}

// What failed before (the server refused a wrong API key, say) went through now: its error is old news.
function clearError(source) {
  if (statusLine.dataset.state === "error" && statusLine.dataset.source === source) setStatus("", "idle");
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    setStatus(await errorMessage(response), "error", "server");
    return;
  }
  const body = await response.json();
  modelName = body.data[0].id;
  contextLength = body.data[0].max_model_len;
  $("model-name").textContent = modelName + " (context " + contextLength + " tokens)";
  clearError("server");
}

// ----- the chart --------------------------------------------------------------------------------------

function decodeLogits(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  return new Float32Array(bytes.buffer); // little-endian float32, as the server writes them
}

function settings() {
  return {
    temperature: parseFloat($("temperature").value),
    topK: parseInt($("top-k").value, 10),
    topP: parseFloat($("top-p").value),
  };
}

// What sampling draws from: softmax(u / T), then top-k, then top-p; T = 0 is the argmax alone.
function samplingDistribution(logits, { temperature, topK, topP }) {
  const V = logits.length;
  const probs = new Float64Array(V);
  if (temperature === 0) {
    let best = 0;
    for (let i = 1; i < V; i++) if (logits[i] > logits[best]) best = i; // the first index wins a tie
    probs[best] = 1;
    return probs;
  }
  const z = Float64Array.from(logits, (u) => u / temperature);
  if (topK > 0 && topK < V) {
    const kth = Float64Array.from(z).sort().reverse()[topK - 1];
    for (let i = 0; i < V; i++) if (z[i] < kth) z[i] = -Infinity; // ties with the k-th are kept
  }
  softmaxInto(z, probs);
  if (topP < 1) {
    // keep a token if the tokens ranked above it do not reach p yet (the crossing token is kept)
    const sorted = Float64Array.from(probs).sort().reverse();
    let before = 0, kept = 0;
    while (kept < V && before < topP - TOP_P_TOLERANCE) before += sorted[kept++];
    const threshold = sorted[kept - 1];
    for (let i = 0; i < V; i++) if (probs[i] < threshold) z[i] = -Infinity;
    softmaxInto(z, probs);
  }
  return probs;
}

function softmaxInto(z, out) {
  let max = -Infinity;
  for (const x of z) if (x > max) max = x;
  let sum = 0;
  for (let i = 0; i < z.length; i++) sum += (out[i] = Math.exp(z[i] - max));
  for (let i = 0; i < z.length; i++) out[i] /= sum;
}

function describe(s) {
  const k = s.topK > 0 ? "top-k " + s.topK : "top-k off";
  const p = s.topP < 1 ? "top-p " + s.topP : "top-p off";
  return "temperature " + s.temperature + (s.temperature === 0 ? " (greedy)" : "") + ", " + k + ", " + p;
}

function drawChart() {
  const chart = $("chart");
  if (!current) return;
  const s = settings();
  const probs = samplingDistribution(current.logits, s);
  const tail = current.text.slice(-30);
  $("chart-caption").textContent = "after \u201c" + (current.text.length > 30 ? "\u2026" : "") + tail +
    "\u201d: the " + CHART_ROWS + " most likely tokens at " + describe(s);
  chart.replaceChildren();
  for (const candidate of current.top.slice(0, CHART_ROWS)) {
    const p = probs[candidate.id];
    const row = document.createElement("div");
    row.className = "bar-row" + (p === 0 ? " dropped" : "");
    row.dataset.tokenId = candidate.id;
    row.dataset.probability = p.toPrecision(8);
    const token = document.createElement("span");
    token.className = "token";
    // a token that is only part of a character comes as "bytes:\xe2\x80"; others show \n and \t escaped
    const partial = candidate.token.startsWith("bytes:");
    token.textContent = partial ? candidate.token.slice(6) : JSON.stringify(candidate.token).slice(1, -1);
    token.title = "token " + candidate.id + (partial ? ": bytes that are only part of a character" : "");
    const track = document.createElement("div");
    track.className = "bar-track";
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = (100 * p).toFixed(2) + "%";
    track.append(bar);
    const label = document.createElement("span");
    label.className = "prob";
    label.textContent = (100 * p).toFixed(p >= 0.1 ? 1 : 2) + "%";
    row.append(token, track, label);
    chart.append(row);
  }
  chart.dataset.temperature = String(s.temperature);
}

async function refreshChart() {
  const text = promptBox.value.slice(0, promptBox.selectionStart);
  const ticket = ++chartRequest;
  try {
    const response = await fetch("/next_token", {
      method: "POST", headers: headers(),
      body: JSON.stringify({ model: modelName, prompt: text, top: CHART_ROWS }),
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      if (ticket === chartRequest) setStatus(message, "error", "server");
      return;
    }
    const body = await response.json();
    if (ticket !== chartRequest) return; // the cursor moved on while this answer came: a newer one is coming
    current = { logits: decodeLogits(body.logits), top: body.top, text };
    clearError("server");
    drawChart();
  } catch (e) {
    // the server went away or the network failed: say so, rather than leave an unhandled rejection
    if (ticket === chartRequest) setStatus("cannot reach the server: " + e.message, "error", "server");
  }
}

let chartTimer = null;
function scheduleChart() {
  clearTimeout(chartTimer);
  chartTimer = setTimeout(refreshChart, 120);
}

// ----- the completion ---------------------------------------------------------------------------------

// As many tokens as asked for, but no more than the context has room for after the text. A text that fills the
// context is cut by the server to its most recent tokens (as every tinylm command reads a long prompt), and the
// response's warning header says so.
async function roomForTokens(wanted) {
  const response = await fetch("/tokenize", {
    method: "POST", headers: headers(), body: JSON.stringify({ model: modelName, prompt: promptBox.value }),
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const room = contextLength - (await response.json()).count;
  return Math.min(wanted, room >= 1 ? room : contextLength - 1);
}

// The max-tokens box as a number, or null (with the box marked invalid) when it is not a whole number >= 1.
function maxTokens() {
  const box = $("max-tokens");
  const text = box.value.trim();
  const ok = /^[0-9]+$/.test(text) && parseInt(text, 10) >= 1;
  box.setAttribute("aria-invalid", ok ? "false" : "true");
  return ok ? parseInt(text, 10) : null;
}

async function generate() {
  const s = settings();
  const wanted = maxTokens();
  if (wanted === null) {
    setStatus("max tokens must be a whole number of at least 1", "error", "max-tokens");
    $("max-tokens").focus();
    return;
  }
  const request = {
    model: modelName, prompt: promptBox.value, stream: true,
    max_tokens: wanted,
    temperature: s.temperature,
  };
  if (s.topK > 0) request.top_k = s.topK;
  if (s.topP < 1) request.top_p = s.topP;
  const seed = $("seed").value.trim();
  const seedOk = seed === "" || /^-?[0-9]+$/.test(seed);
  $("seed").setAttribute("aria-invalid", seedOk ? "false" : "true");
  if (!seedOk) {
    setStatus("the seed must be a whole number (or empty for a fresh one each time)", "error", "seed");
    $("seed").focus();
    return;
  }
  clearError("seed");
  if (seed !== "") request.seed = parseInt(seed, 10);

  streaming = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  promptBox.readOnly = true;
  setStatus("generating\u2026", "streaming");
  let finish = null, pieces = 0;
  try {
    request.max_tokens = await roomForTokens(request.max_tokens);
    const response = await fetch("/v1/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: streaming.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const warning = response.headers.get("X-TinyLM-Warning");
    // server-sent events: "data: {json}" blocks separated by a blank line, then "data: [DONE]"
    const reader = response.body.getReader();
    const decoder = new TextDecoder(); // stream mode: a character split across network packets waits
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!block.startsWith("data: ")) continue;
        const data = block.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          promptBox.value += choice.text;
          promptBox.scrollTop = promptBox.scrollHeight;
          pieces++;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    setStatus("done (" + (finish === "stop" ? "the model stopped" : request.max_tokens + " tokens") + ")" +
              (warning ? "; warning: " + warning : ""), "done");
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped", "done");
    else setStatus(e.message, "error", "generate");
  } finally {
    streaming = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
    promptBox.readOnly = false;
    promptBox.focus();
    promptBox.setSelectionRange(promptBox.value.length, promptBox.value.length);
    refreshChart();
  }
}

// ----- wiring -----------------------------------------------------------------------------------------

function showValue(id, format) {
  const input = $(id);
  const update = () => { $(id + "-value").textContent = format(parseFloat(input.value)); };
  input.addEventListener("input", () => { update(); drawChart(); });
  update();
}

showValue("temperature", (v) => String(v));
showValue("top-k", (v) => (v > 0 ? String(v) : "off"));
showValue("top-p", (v) => (v < 1 ? String(v) : "off"));
for (const event of ["input", "click", "keyup", "select"]) promptBox.addEventListener(event, scheduleChart);
$("generate").addEventListener("click", generate);
$("max-tokens").addEventListener("input", () => { if (maxTokens() !== null) clearError("max-tokens"); });
$("stop").addEventListener("click", () => streaming && streaming.abort());
$("api-key").value = localStorage.getItem("tinylm-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("tinylm-api-key", $("api-key").value.trim());
  loadModel().then(refreshChart);
});

loadModel().then(() => {
  promptBox.setSelectionRange(promptBox.value.length, promptBox.value.length);
  return refreshChart();
});
