// gaussdp text page: perturb in the browser (Web Worker), then upload -> fine-tune -> download.
// The raw text never leaves this page: only the perturbed text is posted (to /text/submit or
// /v1/corpora). The API key is read from the input field and kept in sessionStorage at most.
"use strict";
(function () {
  const MAX_BYTES = 20000000;
  const core = window.gaussdpCore;
  const state = { payload: null, vocab: null, loading: null, result: null, corpusId: null, jobId: null };

  function loadVocab() {
    if (state.vocab) return Promise.resolve(state.vocab);
    if (!state.loading) {
      state.loading = fetch("/text/vocab").then((r) => {
        if (!r.ok) throw new Error("vocabulary request failed: " + r.status);
        return r.json();
      }).then((j) => { state.payload = j; state.vocab = core.buildVocab(j); return state.vocab; });
    }
    return state.loading;
  }

  function $(id) { return document.getElementById(id); }
  // Privacy numbers shown rounded up (epsilon, distance); the delta as sent (exact).
  function up(x, digits) { return core.upperText(x, digits); }

  function mechanism() {
    const name = $("mechanism").value;
    if (name === "laplace") return { name: name, epsilon: parseFloat($("epsilon").value) };
    return { name: "gaussian", sigma: parseFloat($("sigma").value) };
  }
  function mechOk(m) { return m.name === "laplace" ? m.epsilon > 0 : m.sigma > 0; }
  function mechQuery(m) {
    return "mechanism=" + m.name + (m.name === "laplace" ? "&epsilon=" + m.epsilon : "&sigma=" + m.sigma);
  }

  // Perturb `text` in Web Workers (one per CPU, at most 8), each on a contiguous share of the lines,
  // in chunks of lines; onProgress(fraction, words). Resolves to {text, stats, seconds, workers}.
  function perturbInWorker(text, mech, onProgress, nWorkers) {
    return loadVocab().then(() => {
      const t0 = performance.now();
      const lines = text.split(/\r\n|\r|\n/);
      const want = nWorkers || Math.min(8, Math.max(1, navigator.hardwareConcurrency || 1));
      const k = Math.max(1, Math.min(want, Math.ceil(lines.length / 500)));
      const per = Math.ceil(lines.length / k);
      const done = new Array(k).fill(0), words = new Array(k).fill(0);
      const report = () => onProgress(done.reduce((a, b) => a + b, 0) / lines.length, words.reduce((a, b) => a + b, 0));
      const jobs = [];
      for (let w = 0; w < k; w++) {
        const share = lines.slice(w * per, (w + 1) * per).join("\n");
        jobs.push(new Promise((resolve, reject) => {
          const worker = new Worker("/text/static/text_worker.js");
          worker.onmessage = (e) => {
            const m = e.data;
            if (m.type === "ready") worker.postMessage({ type: "run", text: share, mech: mech, chunk: 1000 });
            else if (m.type === "progress") { done[w] = m.lines; words[w] = m.words; report(); }
            else if (m.type === "done") { worker.terminate(); resolve(m); }
            else if (m.type === "error") { worker.terminate(); reject(new Error(m.message)); }
          };
          worker.onerror = (e) => { worker.terminate(); reject(new Error(e.message)); };
          worker.postMessage({ type: "vocab", payload: state.payload });
        }));
      }
      return Promise.all(jobs).then((parts) => {
        const stats = { words: 0, changed: 0, unknown: 0 };
        for (const p of parts) { stats.words += p.stats.words; stats.changed += p.stats.changed; stats.unknown += p.stats.unknown; }
        return { text: parts.map((p) => p.text).join("\n"), stats: stats, seconds: (performance.now() - t0) / 1000, workers: k };
      });
    });
  }

  // Test hooks (also usable from the console).
  window.gaussdpText = {
    tokenize: core.tokenize, loadVocab: loadVocab,
    perturbText: (text, sigma) => loadVocab().then((v) => {
      const stats = { words: 0, changed: 0, unknown: 0 };
      const lines = core.perturbLines(v, text.split(/\r\n|\r|\n/), { name: "gaussian", sigma: sigma }, stats);
      return { text: lines.join("\n"), words: stats.words, changed: stats.changed, unknown: stats.unknown };
    }),
    sampleWord: (w, sigma, n, mech) => loadVocab().then((v) =>
      core.sampleWord(v, w, mech || { name: "gaussian", sigma: sigma }, n)),
    subwordVectors: (words) => loadVocab().then((v) => words.map((w) => Array.from(core.subwordVector(v, w)))),
    perturbInWorker: perturbInWorker,
    // words/s of the page's search + noise on n random vocabulary words, in the worker.
    benchWorker: (n, mech, workers) => loadVocab().then((v) => {
      const ws = [];
      for (let i = 0; i < n; i++) ws.push(v.words[i % v.words.length]);
      const lines = [];
      for (let i = 0; i < n; i += 20) lines.push(ws.slice(i, i + 20).join(" "));
      return perturbInWorker(lines.join("\n"), mech || { name: "gaussian", sigma: 0.5 }, () => {}, workers)
        .then((r) => ({ words: r.stats.words, seconds: r.seconds, words_per_s: r.stats.words / r.seconds, workers: r.workers }));
    }),
  };

  function apiKey() {
    const k = $("apikey").value.trim();
    if (k) { try { sessionStorage.setItem("gaussdp.apiKey", k); } catch (e) { /* storage off */ } }
    return k;
  }
  function authed(url, opts) {
    opts = opts || {};
    opts.headers = Object.assign({}, opts.headers || {}, { Authorization: "Bearer " + apiKey() });
    return fetch(url, opts);
  }
  function readJson(r) {
    return r.text().then((t) => {
      let j = null;
      try { j = t ? JSON.parse(t) : null; } catch (e) { j = { detail: t }; }
      if (!r.ok) throw new Error(r.status + ": " + (j && j.detail ? JSON.stringify(j.detail) : t));
      return j;
    });
  }

  function showGuarantee() {
    const m = mechanism();
    if (!mechOk(m)) { $("guarantee").textContent = "the noise parameter must be > 0"; return; }
    fetch("/text/guarantee?" + mechQuery(m)).then((r) => r.json()).then((g) => {
      if (g.detail) { $("guarantee").textContent = String(JSON.stringify(g.detail)); return; }
      const nn = g.nearest_neighbour, worst = g.vocabulary_diameter;
      $("guarantee").textContent =
        "Per word: epsilon " + up(nn.epsilon, 4) + " (delta " + nn.delta + ") against its typical " +
        "nearest neighbour (distance " + up(nn.distance, 3) + "); epsilon " +
        up(worst.epsilon, 4) + " against any other word (distance " + up(worst.distance, 3) +
        "). " + (m.name === "gaussian" ? "zCDP rho adds over the words of a text. " : "Epsilons add over the words of a text. ") +
        (g.unknown_words || "");
    }).catch(() => {});
  }

  function showJob(j) {
    $("job").textContent = "job " + state.jobId + ": " + j.state + ", step " + (j.step || 0) + "/" + (j.steps || "?") +
      ", epsilon so far " + (j.epsilon_so_far == null ? "-" : up(Number(j.epsilon_so_far), 4)) +
      ", loss " + (j.loss == null ? "-" : Number(j.loss).toPrecision(4));
    if (j.steps) { $("job-progress").max = j.steps; $("job-progress").value = j.step || 0; }
    if (j.state === "succeeded") { $("job-progress").value = $("job-progress").max; fetchAdapter(); }
    return ["succeeded", "failed", "cancelled"].indexOf(j.state) >= 0;
  }

  // Server-sent events over fetch (EventSource cannot send the Authorization header); polling fallback.
  function watchJob() {
    const url = "/v1/finetune-jobs/" + encodeURIComponent(state.jobId);
    let finished = false;
    const poll = () => {
      if (finished) return;
      authed(url).then(readJson).then((j) => { finished = showJob(j); if (!finished) setTimeout(poll, 1000); })
        .catch((e) => { $("job").textContent = String(e); });
    };
    authed(url + "/events", { headers: { Accept: "text/event-stream" } }).then((r) => {
      if (!r.ok || !r.body) throw new Error("no event stream");
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      const pump = () => reader.read().then(({ value, done }) => {
        if (done) { if (!finished) poll(); return; }
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const evt = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = evt.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
          if (data) { try { finished = showJob(JSON.parse(data)) || finished; } catch (e) { /* comment/keepalive */ } }
        }
        if (finished) { reader.cancel(); return; }
        return pump();
      });
      return pump();
    }).catch(() => poll());
  }

  function fetchAdapter() {
    authed("/v1/finetune-jobs/" + encodeURIComponent(state.jobId) + "/adapter").then((r) => {
      if (!r.ok) throw new Error("adapter: " + r.status);
      return r.blob();
    }).then((b) => {
      const a = $("download");
      a.href = URL.createObjectURL(b);
      a.download = "adapter-" + state.jobId + ".zip";
      a.dataset.bytes = String(b.size);
      a.hidden = false;
      $("status").textContent = "adapter ready (" + b.size + " bytes)";
    }).catch((e) => { $("status").textContent = String(e); });
  }

  function init() {
    if (!$("perturb")) return;
    try { $("apikey").value = sessionStorage.getItem("gaussdp.apiKey") || ""; } catch (e) { /* storage off */ }
    $("status").textContent = "loading vocabulary...";
    loadVocab().then((v) => {
      $("status").textContent = "vocabulary: " + v.words.length + " words, " + v.dim + " dimensions" +
        (v.sub ? ", subword vectors for unknown words" : "");
      $("perturb").disabled = false;
    }).catch((e) => { $("status").textContent = String(e); });
    $("mechanism").addEventListener("change", () => {
      const lap = $("mechanism").value === "laplace";
      $("sigma-label").hidden = lap;
      $("epsilon-label").hidden = !lap;
      showGuarantee();
    });
    $("sigma").addEventListener("change", showGuarantee);
    $("epsilon").addEventListener("change", showGuarantee);
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
      const m = mechanism();
      const text = $("input").value;
      if (new TextEncoder().encode(text).length > MAX_BYTES) { $("status").textContent = "text over 20 MB"; return; }
      if (!mechOk(m)) { $("status").textContent = "the noise parameter must be > 0"; return; }
      $("perturb").disabled = true;
      $("progress").value = 0;
      perturbInWorker(text, m, (f, words) => { $("progress").value = f; $("status").textContent = "perturbing: " + words + " words"; })
        .then((r) => {
          state.result = { text: r.text, mech: m };
          $("output").value = r.text;
          $("progress").value = 1;
          $("stats").textContent = r.stats.words + " words in " + r.seconds.toFixed(2) + " s, " + r.stats.changed +
            " known words changed, " + r.stats.unknown + " unknown words";
          $("status").textContent = "perturbed";
          $("submit").disabled = false;
          $("upload").disabled = false;
        }).catch((e) => { $("status").textContent = String(e); })
        .finally(() => { $("perturb").disabled = false; });
    });
    $("submit").addEventListener("click", () => {
      // Only the perturbed text (and the public noise parameter) leaves the browser.
      const m = state.result.mech;
      const body = { text: state.result.text, mechanism: m.name };
      if (m.name === "laplace") body.epsilon = m.epsilon; else body.sigma = m.sigma;
      authed("/text/submit", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })
        .then((r) => r.json().then((j) => ({ ok: r.ok, j: j })))
        .then(({ ok, j }) => { $("status").textContent = ok ? "submitted: " + j.words + " words" : "refused: " + JSON.stringify(j.detail); });
    });
    $("upload").addEventListener("click", () => {
      const m = state.result.mech;
      const q = "name=" + encodeURIComponent($("corpus-name").value || "corpus") + "&format=lines&" + mechQuery(m) +
        "&vocabulary=" + encodeURIComponent(state.payload.id || "");
      // The body is the perturbed text only, one record per line.
      authed("/v1/corpora?" + q, { method: "POST", headers: { "Content-Type": "text/plain; charset=utf-8" }, body: state.result.text })
        .then(readJson).then((j) => {
          state.corpusId = j.id;
          $("corpus").textContent = "corpus " + j.id + ": " + j.records + " records, " + j.bytes + " bytes";
          $("start").disabled = false;
        }).catch((e) => { $("corpus").textContent = "upload refused: " + e.message; });
    });
    $("models").addEventListener("click", () => {
      authed("/v1/models").then(readJson).then((list) => {
        const items = Array.isArray(list) ? list : (list.models || list.data || []);
        $("model").innerHTML = "";
        for (const mdl of items) {
          const o = document.createElement("option");
          o.value = o.textContent = mdl.name;
          $("model").appendChild(o);
        }
        $("status").textContent = items.length + " model(s)";
      }).catch((e) => { $("status").textContent = "models: " + e.message; });
    });
    // The job is charged to a session's budget before it is queued: the one named, or a new session
    // whose budget is exactly the job's (epsilon, delta).
    function payingSession(epsilon, delta) {
      const named = $("session").value.trim();
      if (named) return Promise.resolve(named);
      const body = { epsilon: epsilon, delta: delta };
      return authed("/v1/sessions", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })
        .then(readJson).then((s) => { $("session").value = s.session_id; return s.session_id; });
    }
    $("start").addEventListener("click", () => {
      const epsilon = parseFloat($("target-epsilon").value), delta = parseFloat($("delta").value);
      payingSession(epsilon, delta).then((sessionId) => {
        const body = {
          corpus_id: state.corpusId, model: $("model").value, session_id: sessionId,
          target_epsilon: epsilon, delta: delta,
          epochs: parseInt($("epochs").value, 10), batch_size: parseInt($("batch-size").value, 10),
        };
        return authed("/v1/finetune-jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
      })
        .then(readJson).then((j) => {
          state.jobId = j.id;
          $("download").hidden = true;
          if (!showJob(j)) watchJob();
        }).catch((e) => { $("job").textContent = "job refused: " + e.message; });
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
