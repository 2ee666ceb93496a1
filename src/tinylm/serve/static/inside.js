// The playground's inside view: how the text in the box splits into tokens, and an attention heatmap
// of one layer's head over those tokens. Plain JavaScript and a <canvas>, no libraries (the page works
// offline). Loaded after playground.js, whose $, promptBox, headers() and errorMessage() it uses.
//
// The pieces come from POST /explain/tokens, the weights from POST /explain/attention; the heatmap's
// row i is how token i spreads its attention over tokens 0..i. Above the diagonal the causal mask
// leaves nothing to draw, so those cells stay the background colour.
"use strict";

const insideView = $("inside-view");
const heatmap = $("heatmap");
const HEATMAP_BACKGROUND = "#ffffff";
const HEATMAP_SIDE = 480; // px: the canvas is as near this as whole cells allow
let insideRequest = 0; // as chartRequest: a late answer for an older text is dropped
let insideTimer = null;
let shown = null; // {tokens, weights, cell}: what the canvas shows, for the hover caption

function setInsideStatus(text, state) {
  $("inside-status").textContent = text;
  $("inside-status").dataset.state = state;
}

// A token as the page writes it: its bytes when they are only part of a character, else its text with
// \n and \t escaped (as the chart writes tokens).
function tokenLabel(token) {
  return token.text.startsWith("bytes:") ? token.text.slice(6) : JSON.stringify(token.text).slice(1, -1);
}

function showPieces(pieces) {
  const list = $("pieces");
  list.replaceChildren();
  pieces.forEach((piece, k) => {
    const span = document.createElement("span");
    span.className = "piece";
    span.dataset.tokenId = piece.id;
    span.style.background = "hsl(" + ((k * 67) % 360) + ", 75%, 86%)"; // neighbours never share a colour
    span.title = "token " + piece.id + ": bytes " + piece.bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ");
    const text = document.createElement("span");
    text.className = "piece-text";
    text.textContent = tokenLabel(piece);
    const id = document.createElement("span");
    id.className = "piece-id";
    id.textContent = piece.id;
    span.append(text, id);
    list.append(span);
  });
}

// Weight 0 is a pale blue, 1 a deep one (by the square root, so that small weights still show); never the
// background, so every cell the mask allows is visibly drawn.
function cellColour(weight) {
  const a = Math.sqrt(Math.min(Math.max(weight, 0), 1));
  const from = [226, 234, 250], to = [14, 48, 140];
  return "rgb(" + from.map((f, c) => Math.round(f + (to[c] - f) * a)).join(",") + ")";
}

function drawHeatmap(tokens, weights) {
  const T = weights.length;
  const cell = Math.max(2, Math.floor(HEATMAP_SIDE / T));
  heatmap.width = heatmap.height = cell * T;
  const ctx = heatmap.getContext("2d");
  ctx.fillStyle = HEATMAP_BACKGROUND;
  ctx.fillRect(0, 0, heatmap.width, heatmap.height);
  for (let i = 0; i < T; i++) {
    for (let j = 0; j <= i; j++) { // j > i: masked, left empty
      ctx.fillStyle = cellColour(weights[i][j]);
      ctx.fillRect(j * cell, i * cell, cell, cell);
    }
  }
  heatmap.dataset.tokens = T;
  heatmap.dataset.cell = cell;
  shown = { tokens, weights, cell };
}

// The layer and head boxes list what the model has; a choice is kept while it still exists.
function fillChooser(id, count) {
  const select = $(id);
  if (select.options.length === count) return;
  const chosen = Math.min(parseInt(select.value || "0", 10), count - 1);
  select.replaceChildren(...Array.from({ length: count }, (_, k) => new Option(String(k), String(k))));
  select.value = String(chosen);
}

async function postJSON(path, body) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

async function refreshInside() {
  if (insideView.hidden) return;
  const text = promptBox.value;
  const ticket = ++insideRequest;
  const layer = parseInt($("inside-layer").value || "0", 10);
  const head = parseInt($("inside-head").value || "0", 10);
  setInsideStatus("reading\u2026", "loading");
  try {
    const [tokens, attention] = await Promise.all([
      postJSON("/explain/tokens", { model: modelName, text }),
      postJSON("/explain/attention", { model: modelName, text, layer, head }),
    ]);
    if (ticket !== insideRequest) return;
    showPieces(tokens.pieces);
    fillChooser("inside-layer", attention.n_layer);
    fillChooser("inside-head", attention.n_head);
    drawHeatmap(attention.tokens, attention.weights);
    const starts = attention.tokens.filter((t) => t.start).length;
    $("heatmap-caption").textContent = "layer " + layer + ", head " + head + ": " + attention.tokens.length +
      " tokens down (queries) and across (keys), " + starts + " start token" + (starts === 1 ? "" : "s") + " first";
    setInsideStatus(tokens.count + " tokens" + (attention.warning ? "; warning: " + attention.warning : ""), "done");
  } catch (e) {
    if (ticket === insideRequest) setInsideStatus(e.message, "error");
  }
}

function scheduleInside() {
  clearTimeout(insideTimer);
  insideTimer = setTimeout(refreshInside, 250);
}

heatmap.addEventListener("mousemove", (event) => {
  if (!shown) return;
  const i = Math.floor(event.offsetY / shown.cell), j = Math.floor(event.offsetX / shown.cell);
  if (i >= shown.tokens.length || j > i) {
    $("heatmap-hover").textContent = "";
    return;
  }
  $("heatmap-hover").textContent = "\u201c" + tokenLabel(shown.tokens[i]) + "\u201d (" + i + ") attends to \u201c" +
    tokenLabel(shown.tokens[j]) + "\u201d (" + j + "): " + (100 * shown.weights[i][j]).toFixed(1) + "%";
});
$("inside-toggle").addEventListener("click", () => {
  insideView.hidden = !insideView.hidden;
  $("inside-toggle").setAttribute("aria-expanded", String(!insideView.hidden));
  refreshInside();
});
for (const id of ["inside-layer", "inside-head"]) $(id).addEventListener("change", refreshInside);
promptBox.addEventListener("input", scheduleInside);
// after a completion (the status says done) the text has grown without an input event
new MutationObserver(() => { if (statusLine.dataset.state === "done") scheduleInside(); })
  .observe(statusLine, { attributes: true, attributeFilter: ["data-state"] });
