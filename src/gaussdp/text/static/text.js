// gaussdp text local DP, in the browser: the raw text never leaves this page.
// Same tokenisation rule and unknown-word policy as gaussdp.text (Python):
//   word = maximal run of Unicode letters/digits, inner apostrophes allowed, lower-cased;
//   punctuation dropped; line breaks kept; unknown words perturbed from the zero vector.
// Gaussian mechanism: vector + N(0, sigma^2 I) (Box-Muller over crypto.getRandomValues), then the
// nearest vocabulary word by brute force (exact).
"use strict";
(function () {
  const WORD = /[\p{L}\p{N}]+(?:'[\p{L}\p{N}]+)*/gu;
  const MAX_BYTES = 20000000;
  const state = { vocab: null, loading: null };

  function tokenize(line) {
    const out = [];
    for (const m of line.replace(/\u2019/g, "'").matchAll(WORD)) out.push(m[0].toLowerCase());
    return out;
  }

  function linesOfWords(text) {
    return text.split(/\r\n|\r|\n/).map(tokenize);
  }

  function loadVocab() {
    if (state.vocab) return Promise.resolve(state.vocab);
    if (!state.loading) {
      state.loading = fetch("/text/vocab").then((r) => {
        if (!r.ok) throw new Error("vocabulary request failed: " + r.status);
        return r.json();
      }).then((j) => {
        const bin = atob(j.vectors);
        const bytes = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
        const vecs = new Float32Array(bytes.buffer);  // little-endian float32, words x dim
        const n = j.words.length, dim = j.dim;
        if (vecs.length !== n * dim) throw new Error("vocabulary size mismatch");
        const sq = new Float64Array(n);
        for (let i = 0; i < n; i++) {
          let s = 0;
          for (let k = 0; k < dim; k++) { const x = vecs[i * dim + k]; s += x * x; }
          sq[i] = s;
        }
        const index = new Map();
        j.words.forEach((w, i) => index.set(w, i));
        state.vocab = { words: j.words, dim: dim, vecs: vecs, sq: sq, index: index, meta: j };
        return state.vocab;
      });
    }
    return state.loading;
  }

  // Uniform in (0, 1) with 53 random bits from the OS CSPRNG.
  const buf = new Uint32Array(2);
  function uniform() {
    crypto.getRandomValues(buf);
    return ((buf[0] >>> 5) * 67108864 + (buf[1] >>> 6) + 0.5) / 9007199254740992;
  }
  let spare = null;
  function gaussian() {
    if (spare !== null) { const s = spare; spare = null; return s; }
    const u1 = uniform(), u2 = uniform();
    const r = Math.sqrt(-2 * Math.log(u1));
    spare = r * Math.sin(2 * Math.PI * u2);
    return r * Math.cos(2 * Math.PI * u2);
  }

  function nearest(v, y) {
    const dim = v.dim, n = v.words.length, vecs = v.vecs;
    let best = Infinity, bestI = 0;
    for (let i = 0; i < n; i++) {
      let dot = 0;
      const o = i * dim;
      for (let k = 0; k < dim; k++) dot += vecs[o + k] * y[k];
      const s = v.sq[i] - 2 * dot;
      if (s < best) { best = s; bestI = i; }
    }
    return bestI;
  }

  // Index of the released word for input word `w` (unknown -> zero vector).
  function perturbIndex(v, w, sigma) {
    const dim = v.dim;
    const y = new Float64Array(dim);
    const i = v.index.has(w) ? v.index.get(w) : -1;
    for (let k = 0; k < dim; k++) y[k] = (i >= 0 ? v.vecs[i * dim + k] : 0) + sigma * gaussian();
    return nearest(v, y);
  }

  function perturbText(v, text, sigma) {
    let changed = 0, total = 0, unknown = 0;
    const lines = linesOfWords(text).map((ws) => ws.map((w) => {
      const j = perturbIndex(v, w, sigma);
      const out = v.words[j];
      total++;
      if (!v.index.has(w)) unknown++;
      else if (out !== w) changed++;
      return out;
    }).join(" "));
    return { text: lines.join("\n"), words: total, changed: changed, unknown: unknown };
  }

  // Test hook: n releases of word w, returned as released words.
  function sampleWord(v, w, sigma, n) {
    const out = new Array(n);
    for (let t = 0; t < n; t++) out[t] = v.words[perturbIndex(v, w, sigma)];
    return out;
  }

  window.gaussdpText = {
    tokenize: tokenize, loadVocab: loadVocab,
    perturbText: (text, sigma) => loadVocab().then((v) => perturbText(v, text, sigma)),
    sampleWord: (w, sigma, n) => loadVocab().then((v) => sampleWord(v, w, sigma, n)),
  };

  function $(id) { return document.getElementById(id); }

  function showGuarantee() {
    const sigma = parseFloat($("sigma").value);
    if (!(sigma > 0)) { $("guarantee").textContent = "sigma must be > 0"; return; }
    fetch("/text/guarantee?sigma=" + encodeURIComponent(sigma)).then((r) => r.json()).then((g) => {
      if (g.detail) { $("guarantee").textContent = String(g.detail); return; }
      const nn = g.nearest_neighbour, worst = g.vocabulary_diameter;
      $("guarantee").textContent =
        "Per word: epsilon " + nn.epsilon.toPrecision(4) + " (delta " + nn.delta + ") against its typical " +
        "nearest neighbour (distance " + nn.distance.toPrecision(3) + "); epsilon " +
        worst.epsilon.toPrecision(4) + " against any other word (distance " + worst.distance.toPrecision(3) +
        "). Epsilons add up over the words of a text (zCDP rho adds).";
    });
  }

  function init() {
    if (!$("perturb")) return;
    $("status").textContent = "loading vocabulary...";
    loadVocab().then((v) => {
      $("status").textContent = "vocabulary: " + v.words.length + " words, " + v.dim + " dimensions";
      $("perturb").disabled = false;
    }).catch((e) => { $("status").textContent = String(e); });
    $("sigma").addEventListener("change", showGuarantee);
    showGuarantee();
    $("file").addEventListener("change", () => {
      const f = $("file").files[0];
      if (!f) return;
      if (f.size > MAX_BYTES) { $("status").textContent = "file over 20 MB: refused"; return; }
      f.arrayBuffer().then((b) => {
        try {
          $("input").value = new TextDecoder("utf-8", { fatal: true }).decode(b);
        } catch (e) { $("status").textContent = "file is not valid UTF-8: refused"; }
      });
    });
    $("perturb").addEventListener("click", () => {
      const sigma = parseFloat($("sigma").value);
      const text = $("input").value;
      if (new TextEncoder().encode(text).length > MAX_BYTES) { $("status").textContent = "text over 20 MB"; return; }
      if (!(sigma > 0)) { $("status").textContent = "sigma must be > 0"; return; }
      window.gaussdpText.perturbText(text, sigma).then((r) => {
        $("output").value = r.text;
        $("stats").textContent = r.words + " words, " + r.changed + " known words changed, " +
          r.unknown + " unknown words (perturbed from the zero vector)";
        $("submit").disabled = false;
      });
    });
    $("submit").addEventListener("click", () => {
      // Only the perturbed text (and the public sigma) leaves the browser.
      const body = JSON.stringify({ text: $("output").value, mechanism: "gaussian", sigma: parseFloat($("sigma").value) });
      fetch("/text/submit", { method: "POST", headers: { "Content-Type": "application/json" }, body: body })
        .then((r) => r.json().then((j) => ({ ok: r.ok, j: j })))
        .then(({ ok, j }) => { $("status").textContent = ok ? "submitted: " + j.words + " words" : "refused: " + JSON.stringify(j.detail); });
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
