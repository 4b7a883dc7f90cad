// The aioready dashboard: polls /api/snapshot and draws with plain canvas (no libraries, no
// network beyond this server). Each draw sets data-drawn on <body> to the items drawn, which
// the browser test reads.
"use strict";
const STATE = { busy: "#4C78A8", waiting: "#F28E2B", gated: "#E15759", idle: "#D0D0D0" };
const KIND = { F: "#4C78A8", B: "#59A14F", W: "#EDC948" };

function ctx2d(id) {
  const c = document.getElementById(id);
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.font = "11px system-ui, sans-serif";
  return [c, g];
}

function drawOccupancy(snap) {
  const [c, g] = ctx2d("occupancy");
  const n = snap.ranks.length, left = 60, h = Math.min(30, (c.height - 20) / Math.max(n, 1));
  let drawn = 0;
  snap.ranks.forEach((r, i) => {
    let x = left;
    const y = 10 + i * h;
    g.fillStyle = "#222";
    g.fillText("rank " + r.rank, 4, y + h / 2 + 4);
    for (const k of ["busy", "waiting", "gated", "idle"]) {
      const w = r[k] * (c.width - left - 10);
      g.fillStyle = STATE[k];
      g.fillRect(x, y, w, h - 4);
      if (w > 0) drawn++;
      x += w;
    }
  });
  return drawn;
}

function drawSteps(snap) {
  const [c, g] = ctx2d("steps");
  const hist = snap.history;
  if (!hist.length) return 0;
  const top = Math.max(...hist.map(h => h.step_time)) * 1.1 || 1;
  const X = i => 40 + (hist.length > 1 ? i / (hist.length - 1) : 0.5) * (c.width - 50);
  const Y = v => c.height - 20 - v / top * (c.height - 30);
  for (const [key, dash] of [["step_time", []], ["lower_bound", [5, 4]]]) {
    g.setLineDash(dash);
    g.strokeStyle = key === "step_time" ? "#4C78A8" : "#666";
    g.lineWidth = 2;
    g.beginPath();
    hist.forEach((h, i) => (i ? g.lineTo(X(i), Y(h[key])) : g.moveTo(X(i), Y(h[key]))));
    g.stroke();
  }
  g.setLineDash([]);
  g.fillStyle = "#222";
  const last = hist[hist.length - 1];
  g.fillText(`step ${last.step}: ${fmt(last.step_time)} (bound ${fmt(last.lower_bound)},` +
             ` efficiency ${last.efficiency.toFixed(2)})`, 44, 12);
  return hist.length;
}

function drawTimeline(snap) {
  const [c, g] = ctx2d("timeline");
  const last = snap.last_step;
  if (!last) return 0;
  const n = last.num_ranks, h = (c.height - 20) / n, left = 60;
  const end = Math.max(...last.spans.map(s => s[6])) || 1;
  const X = t => left + t / end * (c.width - left - 10);
  for (let r = 0; r < n; r++) {
    g.fillStyle = "#222";
    g.fillText("rank " + r, 4, 10 + r * h + h / 2);
  }
  for (const [rank, chunk, mb, kind, ready, start, stop] of last.spans) {
    const y = 6 + rank * h, w = Math.max(1, X(stop) - X(start));
    g.fillStyle = KIND[kind];
    g.fillRect(X(start), y, w, h - 6);
    if (w > 18) {
      g.fillStyle = "#fff";
      g.fillText(kind + mb + (chunk ? "c" + chunk : ""), X(start) + 2, y + h / 2);
    }
  }
  g.fillStyle = "#222";
  g.fillText(fmt(end), c.width - 60, c.height - 4);
  return last.spans.length;
}

let UNIT_S = 1.0;  // seconds per clock unit (the snapshot says)
function fmt(t) { return (t * UNIT_S * 1000).toFixed(1) + " ms"; }

function table(id, head, rows) {
  const t = document.getElementById(id);
  t.innerHTML = "<tr>" + head.map(h => `<th>${h}</th>`).join("") + "</tr>" +
    rows.map(r => "<tr>" + r.map(v => `<td>${v ?? "-"}</td>`).join("") + "</tr>").join("");
}

function draw(snap) {
  UNIT_S = snap.clock_unit_s;
  const drawn = drawOccupancy(snap) + drawSteps(snap) + drawTimeline(snap);
  table("ranks", ["rank", "busy", "waiting", "gated", "idle", "ready tasks", "in flight / cap",
                  "peak", "on device"],
        snap.ranks.map(r => [r.rank, pct(r.busy), pct(r.waiting), pct(r.gated), pct(r.idle),
                             r.ready, r.in_flight == null ? null : `${r.in_flight} / ${r.cap}`,
                             r.peak_in_flight, r.running_task]));
  table("messages", ["from", "to", "messages", "bytes"],
        snap.messages.map(m => [m.src, m.dest, m.messages, m.bytes]));
  document.getElementById("status").textContent =
    (snap.running ? "running step " + snap.step : "idle") + `, ${snap.steps_done} steps done`;
  document.body.dataset.drawn = String(drawn);
}

function pct(v) { return (100 * v).toFixed(1) + "%"; }

async function poll() {
  try {
    const res = await fetch("api/snapshot", { cache: "no-store" });
    draw(await res.json());
  } catch (err) {
    document.getElementById("status").textContent = "disconnected (" + err + ")";
  }
}
poll();
setInterval(poll, 500);
