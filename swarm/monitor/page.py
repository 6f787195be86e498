"""The monitor's web page: one self-contained HTML file (no CDN, no network beyond this server).

Its script polls `/api/swarm` every POLL_MS and redraws the peer table, the eval-loss chart (inline SVG:
one <circle> per round, mean over the peers that evaluated it; the <svg> carries `data-points`), the
commits and the events. Every string from the swarm goes in through `textContent`, never as HTML: peer
names are chosen by strangers.
"""

POLL_MS = 2000

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>swarm monitor</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.5em; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; }
th { border-bottom: 1px solid #999; } td.l, th.l { text-align: left; }
tr.gone { color: #999; } #status { color: #666; } .err { color: #b00; }
svg { background: #fafafa; border: 1px solid #ddd; }
</style></head>
<body>
<h1>swarm monitor: run <span id="run">?</span></h1>
<div id="status">loading…</div>
<h2>Peers</h2>
<table id="peers"><thead><tr><th class="l">name</th><th class="l">state</th><th>round</th><th>inner step</th>
<th>loss</th><th>tokens/s</th><th>sent</th><th>received</th><th>eval loss</th><th>last seen</th></tr></thead>
<tbody></tbody></table>
<h2>Eval loss per round</h2>
<svg id="chart" width="640" height="240" data-points="0"></svg>
<h2>Commits</h2>
<table id="commits"><thead><tr><th class="l">name</th><th>round</th><th class="l">global parameters</th>
<th>age</th></tr></thead><tbody></tbody></table>
<h2>Events</h2>
<table id="events"><thead><tr><th class="l">time</th><th class="l">event</th><th class="l">peer</th>
<th class="l">detail</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const SVG = "http://www.w3.org/2000/svg";
function fmt(x, digits) { return x === null || x === undefined ? "–" : x.toFixed(digits); }
function bytes(x) {
  if (x === null || x === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"]; let i = 0;
  while (x >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return x.toFixed(i ? 1 : 0) + " " + units[i];
}
function row(cells, cls) {
  const tr = document.createElement("tr"); if (cls) tr.className = cls;
  for (const [text, left] of cells) {
    const td = document.createElement("td"); td.textContent = text; if (left) td.className = "l"; tr.appendChild(td);
  }
  return tr;
}
function fill(id, rows) { document.querySelector("#" + id + " tbody").replaceChildren(...rows); }
function el(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function chart(points) {
  const svg = document.getElementById("chart"), W = 640, H = 240, L = 50, R = 15, T = 15, B = 30;
  const parts = [];
  svg.setAttribute("data-points", points.length);
  if (points.length) {
    const r0 = Math.min(...points.map(p => p.round)), r1 = Math.max(...points.map(p => p.round));
    let y0 = Math.min(...points.map(p => p.mean)), y1 = Math.max(...points.map(p => p.mean));
    if (y1 - y0 < 1e-9) { y0 -= 0.5; y1 += 0.5; }
    const x = r => L + (r1 > r0 ? (r - r0) / (r1 - r0) : 0.5) * (W - L - R);
    const y = v => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
    parts.push(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
    parts.push(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
    parts.push(el("text", {x: 4, y: T + 10, "font-size": 11}, y1.toFixed(3)));
    parts.push(el("text", {x: 4, y: H - B, "font-size": 11}, y0.toFixed(3)));
    parts.push(el("text", {x: L, y: H - 8, "font-size": 11}, "round " + r0));
    parts.push(el("text", {x: W - R - 60, y: H - 8, "font-size": 11}, "round " + r1));
    parts.push(el("polyline", {fill: "none", stroke: "#36c", "stroke-width": 1.5,
                               points: points.map(p => x(p.round) + "," + y(p.mean)).join(" ")}));
    for (const p of points) {
      const c = el("circle", {cx: x(p.round), cy: y(p.mean), r: 3.5, fill: "#36c", "data-round": p.round});
      c.appendChild(el("title", {}, "round " + p.round + ": " + p.mean.toFixed(4) + " (" + p.peers + " peers)"));
      parts.push(c);
    }
  } else {
    parts.push(el("text", {x: 20, y: 120, fill: "#999"}, "no eval loss published yet"));
  }
  svg.replaceChildren(...parts);
}
function draw(s) {
  document.getElementById("run").textContent = s.run;
  const live = s.peers.filter(p => p.live).length;
  document.getElementById("status").textContent = live + " live peers, " + (s.peers.length - live) +
    " gone; fingerprint " + (s.fingerprint || "–") + "; " + s.reads + " DHT reads (" + s.failed_reads +
    " timed out), last " + fmt(s.last_read_age_s, 1) + " s ago";
  fill("peers", s.peers.map(p => row([[p.name, 1], [p.live ? (p.ready ? "averaging" : "training") : "gone", 1],
    [String(p.round)], [String(p.inner_step)], [fmt(p.loss, 4)], [fmt(p.tokens_per_s, 0)], [bytes(p.bytes_sent)],
    [bytes(p.bytes_received)], [p.eval_loss === null ? "–" : fmt(p.eval_loss, 4) + " @" + p.eval_round],
    [fmt(p.last_seen_s, 1) + " s"]], p.live ? "live" : "gone")));
  chart(s.eval);
  fill("commits", s.commits.map(c => row([[c.name, 1], [String(c.round)], [c.sha256.slice(0, 16), 1],
    [fmt(c.age_s, 0) + " s"]])));
  fill("events", s.events.slice().reverse().map(e => row([[new Date(e.time * 1000).toLocaleTimeString(), 1],
    [e.kind, 1], [e.peer, 1], [e.detail, 1]])));
}
async function poll() {
  try {
    const response = await fetch("/api/swarm", {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    draw(await response.json());
    document.getElementById("status").classList.remove("err");
  } catch (e) {
    const status = document.getElementById("status");
    status.textContent = "monitor unreachable: " + e.message; status.classList.add("err");
  }
  setTimeout(poll, POLL_MS_VALUE);
}
poll();
</script>
</body></html>
""".replace("POLL_MS_VALUE", str(POLL_MS))
