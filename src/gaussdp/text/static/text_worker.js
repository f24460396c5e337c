// Web Worker: perturbs a long text in chunks of lines, reporting progress; the page stays responsive.
// Messages in:  {type: "vocab", payload} (the /text/vocab JSON) | {type: "run", text, mech, chunk}
// Messages out: {type: "ready"} | {type: "progress", lines, total, words} | {type: "done", text, stats, seconds}
"use strict";
importScripts("/text/static/text_core.js");
let vocab = null;
self.onmessage = (e) => {
  const m = e.data;
  try {
    if (m.type === "vocab") { vocab = self.gaussdpCore.buildVocab(m.payload); self.postMessage({ type: "ready" }); return; }
    if (m.type !== "run") return;
    const t0 = performance.now();
    const lines = m.text.split(/\r\n|\r|\n/);
    const chunk = m.chunk || 2000, out = [];
    const stats = { words: 0, changed: 0, unknown: 0 };
    for (let lo = 0; lo < lines.length; lo += chunk) {
      const part = self.gaussdpCore.perturbLines(vocab, lines.slice(lo, lo + chunk), m.mech, stats);
      for (const l of part) out.push(l);
      self.postMessage({ type: "progress", lines: Math.min(lo + chunk, lines.length), total: lines.length, words: stats.words });
    }
    self.postMessage({ type: "done", text: out.join("\n"), stats: stats, seconds: (performance.now() - t0) / 1000 });
  } catch (err) {
    self.postMessage({ type: "error", message: String(err) });
  }
};
