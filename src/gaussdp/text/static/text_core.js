// gaussdp text local DP: the computation shared by the page and its Web Worker (plain JavaScript).
// Mirrors gaussdp.text (Python) exactly where it matters:
//   tokenize      = gaussdp.text.tokenize.words (letters/digits, inner apostrophes, lower-cased);
//   subwordVector = gaussdp.text.subwords.SubwordTable.vector (same n-grams, FNV-1a hashes, float64
//                   sums in n-gram order, one float32 rounding, clip, scale into the max-norm ball);
//   gaussian      = vector + N(0, sigma^2 I)       (GaussianWordMechanism);
//   laplace       = vector + Gamma(dim, 1/eps) * uniform direction (LaplaceWordMechanism,
//                   Feyisetan et al. 2020; the radius as 0.5/eps * chi2(2 dim) from normals);
//   nearest       = exact nearest word, float64 arithmetic, ties to the lowest index.
// Randomness: crypto.getRandomValues only (the OS CSPRNG), 53-bit uniforms, Box-Muller normals.
"use strict";
(function (root) {
  const WORD = /[\p{L}\p{N}]+(?:'[\p{L}\p{N}]+)*/gu;

  function tokenize(line) {
    const out = [];
    for (const m of line.replace(/\u2019/g, "'").matchAll(WORD)) out.push(m[0].toLowerCase());
    return out;
  }

  function b64bytes(s) {
    const bin = atob(s);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return bytes;
  }

  function f16(h) {  // exact float16 -> number
    const s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    if (e === 0) return s * f * Math.pow(2, -24);
    if (e === 31) return f ? NaN : s * Infinity;
    return s * (1 + f / 1024) * Math.pow(2, e - 15);
  }

  // Build the in-memory vocabulary from the /text/vocab payload (JSON).
  function buildVocab(j) {
    const vecs = new Float32Array(b64bytes(j.vectors).buffer);  // little-endian float32, words x dim
    const n = j.words.length, dim = j.dim;
    if (vecs.length !== n * dim) throw new Error("vocabulary size mismatch");
    const w64 = new Float64Array(vecs);
    const sq = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      let s = 0;
      for (let k = 0; k < dim; k++) { const x = w64[i * dim + k]; s += x * x; }
      sq[i] = s;
    }
    const index = new Map();
    j.words.forEach((w, i) => index.set(w, i));
    let sub = null;
    if (j.subwords) {
      const raw = b64bytes(j.subwords.table);
      const u16 = new Uint16Array(raw.buffer);
      const table = new Float64Array(u16.length);
      for (let i = 0; i < u16.length; i++) table[i] = f16(u16[i]);
      if (table.length !== j.subwords.buckets * dim) throw new Error("subword table size mismatch");
      sub = { minN: j.subwords.min_n, maxN: j.subwords.max_n, buckets: j.subwords.buckets,
              clip: j.subwords.clip, maxNorm: j.subwords.max_norm, table: table, cache: new Map() };
    }
    return { name: j.name, words: j.words, dim: dim, clip: j.clip, vecs: w64, sq: sq, index: index, sub: sub };
  }

  const encoder = new TextEncoder();
  function ngramHashes(word, minN, maxN, buckets) {
    const data = encoder.encode("<" + word + ">");
    const size = data.length, out = [];
    for (let i = 0; i < size; i++) {
      if ((data[i] & 0xc0) === 0x80) continue;
      let j = i, n = 1;
      while (j < size && n <= maxN) {
        j++;
        while (j < size && (data[j] & 0xc0) === 0x80) j++;
        if (n >= minN && !(n === 1 && (i === 0 || j === size))) {
          let h = 2166136261;
          for (let t = i; t < j; t++) {
            h = (h ^ ((data[t] << 24) >> 24)) >>> 0;  // xor the byte as a signed char, like fastText
            h = Math.imul(h, 16777619) >>> 0;
          }
          out.push(h % buckets);
        }
        n++;
      }
    }
    return out;
  }

  // The public vector of an unknown word (zero vector without a subword table).
  function subwordVector(v, word) {
    const dim = v.dim, out = new Float64Array(dim);
    const sub = v.sub;
    if (!sub) return out;
    const hit = sub.cache.get(word);
    if (hit) return hit;
    const hashes = ngramHashes(word, sub.minN, sub.maxN, sub.buckets);
    if (hashes.length) {
      for (const h of hashes) for (let k = 0; k < dim; k++) out[k] += sub.table[h * dim + k];
      let s = 0;
      for (let k = 0; k < dim; k++) {
        let x = Math.fround(out[k] / hashes.length);
        x = Math.min(Math.max(x, -sub.clip), sub.clip);
        out[k] = x;
        s += x * x;
      }
      const norm = Math.sqrt(s);
      if (norm > sub.maxNorm) {
        const f = sub.maxNorm / norm;
        for (let k = 0; k < dim; k++) out[k] = Math.fround(out[k] * f);
      }
    }
    if (sub.cache.size < 100000) sub.cache.set(word, out);
    return out;
  }

  // Uniforms in (0, 1) with 53 random bits, from the OS CSPRNG in batches.
  const pool = new Uint32Array(16384);
  let pos = pool.length;
  function uniform() {
    if (pos + 2 > pool.length) { crypto.getRandomValues(pool); pos = 0; }
    const a = pool[pos++], b = pool[pos++];
    return ((a >>> 5) * 67108864 + (b >>> 6) + 0.5) / 9007199254740992;
  }
  let spare = null;
  function normal() {
    if (spare !== null) { const s = spare; spare = null; return s; }
    const r = Math.sqrt(-2 * Math.log(uniform())), t = 2 * Math.PI * uniform();
    spare = r * Math.sin(t);
    return r * Math.cos(t);
  }

  // Noisy vector y = x + noise for mechanism {name: "gaussian", sigma} or {name: "laplace", epsilon}.
  function noisy(x, dim, mech, y) {
    if (mech.name === "gaussian") {
      for (let k = 0; k < dim; k++) y[k] = x[k] + mech.sigma * normal();
      return y;
    }
    let r = 0;
    for (let k = 0; k < 2 * dim; k++) { const z = normal(); r += z * z; }
    r *= 0.5 / mech.epsilon;  // Gamma(dim, scale 1/epsilon) = (1/epsilon) * chi2(2 dim) / 2
    let nn = 0;
    do {
      nn = 0;
      for (let k = 0; k < dim; k++) { y[k] = normal(); nn += y[k] * y[k]; }
    } while (nn === 0);
    const f = r / Math.sqrt(nn);
    for (let k = 0; k < dim; k++) y[k] = x[k] + f * y[k];
    return y;
  }

  // Exact nearest word: smallest ||w||^2 - 2 y.w in float64 over every word, ties to the lowest index.
  function nearest(v, y) {
    const dim = v.dim, n = v.words.length, vecs = v.vecs, sq = v.sq;
    let best = Infinity, bestI = 0;
    for (let i = 0, o = 0; i < n; i++, o += dim) {
      let dot = 0;
      for (let k = 0; k < dim; k++) dot += vecs[o + k] * y[k];
      const s = sq[i] - 2 * dot;
      if (s < best) { best = s; bestI = i; }
    }
    return bestI;
  }

  function inputVector(v, w) {
    const i = v.index.has(w) ? v.index.get(w) : -1;
    return i >= 0 ? v.vecs.subarray(i * v.dim, (i + 1) * v.dim) : subwordVector(v, w);
  }

  // Perturb lines of text (one output line per input line); counts words, unknown and changed in stats.
  function perturbLines(v, lines, mech, stats) {
    const y = new Float64Array(v.dim);
    return lines.map((line) => tokenize(line).map((w) => {
      const known = v.index.has(w);
      const out = v.words[nearest(v, noisy(inputVector(v, w), v.dim, mech, y))];
      stats.words++;
      if (!known) stats.unknown++;
      else if (out !== w) stats.changed++;
      return out;
    }).join(" "));
  }

  function sampleWord(v, w, mech, n) {
    const y = new Float64Array(v.dim), x = inputVector(v, w), out = new Array(n);
    for (let t = 0; t < n; t++) out[t] = v.words[nearest(v, noisy(x, v.dim, mech, y))];
    return out;
  }

  // `x` rounded UP to `digits` significant digits (gaussdp._format.format_upper): the decimal shown
  // is never below the float it stands for, so a printed epsilon stays an upper bound. toPrecision
  // rounds to nearest; here the float's exact value (mantissa * 2^e as a BigInt decimal) is cut.
  function upperText(x, digits) {
    if (typeof x !== "number" || Number.isNaN(x)) throw new Error("refusing to print a non-number");
    if (!Number.isFinite(x) || x === 0) return x === 0 ? "0" : String(x);
    const view = new DataView(new ArrayBuffer(8));
    view.setFloat64(0, Math.abs(x));
    const bits = view.getBigUint64(0);
    const biased = Number((bits >> 52n) & 0x7ffn);
    let mant = bits & ((1n << 52n) - 1n), e2 = -1074;
    if (biased !== 0) { mant |= 1n << 52n; e2 = biased - 1075; }
    // |x| = num * 10^e10 exactly (2^-k = 5^k * 10^-k)
    const num = e2 >= 0 ? mant << BigInt(e2) : mant * 5n ** BigInt(-e2), e10 = Math.min(e2, 0);
    const s = num.toString(), cut = Math.max(0, s.length - digits);
    let head = BigInt(s.slice(0, s.length - cut)), scale = e10 + cut;
    if (x > 0 && /[1-9]/.test(s.slice(s.length - cut))) head += 1n;  // up; a negative x is cut toward 0
    let h = head.toString();
    if (h.length > digits) { h = h.slice(0, digits); scale += 1; }  // 999.. + 1 carried: a trailing 0
    if (h.length < digits) { scale -= digits - h.length; h = h.padEnd(digits, "0"); }
    // |shown| = h * 10^scale, h of exactly `digits` digits, laid out as toPrecision does, no float
    const lead = scale + digits - 1, sign = x < 0 ? "-" : "";
    if (lead < -6 || lead >= digits) {
      return sign + h[0] + (digits > 1 ? "." + h.slice(1) : "") + "e" + (lead < 0 ? "-" : "+") + Math.abs(lead);
    }
    if (lead >= 0) return sign + h.slice(0, lead + 1) + (lead + 1 < digits ? "." + h.slice(lead + 1) : "");
    return sign + "0." + "0".repeat(-lead - 1) + h;
  }

  root.gaussdpCore = {
    tokenize: tokenize, buildVocab: buildVocab, ngramHashes: ngramHashes, subwordVector: subwordVector,
    perturbLines: perturbLines, sampleWord: sampleWord, nearest: nearest, noisy: noisy, upperText: upperText,
  };
})(typeof self !== "undefined" ? self : this);
