/* gaussdp._search: the fused kernel of gaussdp.text.search.ExactSearch (one block of queries).
 *
 * The same algorithm and the same proof as the numpy path of gaussdp/text/search.py (see its module
 * docstring); this file only avoids materialising the block x vocabulary matrix of float32 bounds:
 *
 * 1. for tiles of QT queries and blocks of WB words, the float32 bounds
 *        s_w = sum_j qa[j] * operand[j][w]      (j < k1: -2 P^T w . P^T q + ||P^T w||^2)
 *    are computed in registers (16 words per vector) and only each block's minimum is kept;
 * 2. per query, the word w0 with the smallest bound (lowest index among equal bounds) gives
 *    U = ||q - w0||^2 (float64) * (1 + 1e-12) and the threshold thr = U + offset[q], where
 *    offset = eps_q - ||P^T q||^2 comes from Python (every float32 error of the bound);
 * 3. the blocks whose minimum is <= thr are computed again; every word with s_w <= thr is a
 *    candidate and its squared distance is computed in float64. The smallest one wins, the lowest
 *    index among equal float64 distances.
 *
 * The threshold is compared in float32 after rounding it *up* (so the candidate set can only grow:
 * the true nearest word is still in it). The float32 error bound of Higham's Theorem 3.5 holds for
 * any order of summation and with fused multiply-adds, so vectorisation does not change it. No
 * -ffast-math: comparisons and float64 distances follow IEEE 754.
 *
 * A query is handed back to the numpy path (status 1) when its runner-up candidate is within 1e-13
 * relative of the best float64 distance (a near-tie, decided there in exact rational arithmetic),
 * when it has more than `limit` candidates, or when it has none (impossible by the proof; the numpy
 * path then refuses to guess).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define LANES 16
#ifndef QT
#define QT 8 /* queries per tile: QT vector accumulators */
#endif
#ifndef WB
#define WB 512 /* words per block whose minimum bound is kept */
#endif
#define TIE_BAND 1e-13

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

/* lane-wise minimum (a macro: a function returning a vector would warn about the AVX-512 ABI) */
#define VMIN16(a, b) ((v16)((((i16)(a)) & ((a) < (b))) | (((i16)(b)) & ~((a) < (b)))))

/* Pass 1: minimum bound per (query, block) for the queries [q0, q0 + nq), nq <= QT. */
CLONES static void tile_minima(const float *qa, size_t k1, size_t nq, const float *op, size_t vp,
                               size_t nblocks, float *bmin /* nq x nblocks */) {
    float qt[QT][64];
    size_t kk = k1 < 64 ? k1 : 64;
    memset(qt, 0, sizeof(qt));
    for (size_t i = 0; i < nq; i++)
        for (size_t j = 0; j < kk; j++) qt[i][j] = qa[i * k1 + j];
    for (size_t b = 0; b < nblocks; b++) {
        size_t lo = b * WB, hi = lo + WB < vp ? lo + WB : vp;
        v16 m[QT];
        for (int i = 0; i < QT; i++) m[i] = (v16){0} + INFINITY;
        for (size_t w = lo; w < hi; w += LANES) {
            v16 acc[QT];
            for (int i = 0; i < QT; i++) acc[i] = (v16){0};
            for (size_t j = 0; j < kk; j++) {
                v16 o = *(const v16u *)(op + j * vp + w);
                for (int i = 0; i < QT; i++) acc[i] += qt[i][j] * o;
            }
            for (int i = 0; i < QT; i++) m[i] = VMIN16(acc[i], m[i]);
        }
        for (size_t i = 0; i < nq; i++) {
            float best = INFINITY;
            for (int l = 0; l < LANES; l++) best = m[i][l] < best ? m[i][l] : best;
            bmin[i * nblocks + b] = best;
        }
    }
}

/* The bounds of one query for the words [lo, hi) (hi - lo a multiple of LANES, <= WB). */
CLONES static void row_scores(const float *qa, size_t k1, const float *op, size_t vp, size_t lo,
                              size_t hi, float *out) {
    for (size_t w = lo; w < hi; w += LANES) {
        v16 acc = (v16){0};
        for (size_t j = 0; j < k1; j++) acc += qa[j] * *(const v16u *)(op + j * vp + w);
        *(v16u *)(out + (w - lo)) = acc;
    }
}

static double sq_dist(const float *q, const float *w, size_t dim) {
    double s = 0.0;
    for (size_t i = 0; i < dim; i++) {
        double d = (double)w[i] - (double)q[i];
        s += d * d;
    }
    return s;
}

/* Round a double up to a float: the float threshold is never below the double one. */
static float up32(double x) {
    if (isnan(x)) return INFINITY;
    float f = (float)x;
    if ((double)f < x) f = nextafterf(f, INFINITY);
    return f;
}

static void search_block(const float *qa, size_t k1, const float *op, size_t vp, size_t n_vocab,
                         const float *vecs, const float *q, size_t dim, const double *offset,
                         int64_t limit, size_t m, int64_t *out, int8_t *status, float *bmin) {
    size_t nblocks = (vp + WB - 1) / WB;
    float scores[WB];
    for (size_t q0 = 0; q0 < m; q0 += QT) {
        size_t nq = m - q0 < QT ? m - q0 : QT;
        tile_minima(qa + q0 * k1, k1, nq, op, vp, nblocks, bmin);
        for (size_t i = 0; i < nq; i++) {
            size_t r = q0 + i;
            const float *qar = qa + r * k1, *qr = q + r * dim;
            const float *bm = bmin + i * nblocks;
            size_t bstar = 0;
            for (size_t b = 1; b < nblocks; b++)
                if (bm[b] < bm[bstar]) bstar = b;
            size_t lo = bstar * WB, hi = lo + WB < vp ? lo + WB : vp;
            row_scores(qar, k1, op, vp, lo, hi, scores);
            size_t w0 = n_vocab;
            float s0 = INFINITY;
            for (size_t w = lo; w < hi && w < n_vocab; w++)
                if (w0 == n_vocab || scores[w - lo] < s0) { s0 = scores[w - lo]; w0 = w; }
            if (w0 == n_vocab) { status[r] = 1; out[r] = -1; continue; }
            double upper = sq_dist(qr, vecs + w0 * dim, dim) * (1.0 + 1e-12);
            float thr = up32(upper + offset[r]);
            int64_t count = 0, best_i = -1;
            double best = INFINITY, second = INFINITY;
            int over = 0;
            /* More passing blocks than the limit: hand the row back at once (always safe). */
            for (size_t b = 0; b < nblocks && !over; b++)
                if (bm[b] <= thr && ++count > limit) over = 1;
            count = 0;
            for (size_t b = 0; b < nblocks && !over; b++) {
                if (!(bm[b] <= thr)) continue;
                size_t blo = b * WB, bhi = blo + WB < vp ? blo + WB : vp;
                row_scores(qar, k1, op, vp, blo, bhi, scores);
                for (size_t w = blo; w < bhi && w < n_vocab; w++) {
                    if (!(scores[w - blo] <= thr)) continue;
                    if (++count > limit) { over = 1; break; }
                    double d = sq_dist(qr, vecs + w * dim, dim);
                    if (d < best) { second = best; best = d; best_i = (int64_t)w; }
                    else if (d < second) second = d;
                }
            }
            if (over || best_i < 0 || second <= best * (1.0 + TIE_BAND) + 1e-300) {
                status[r] = 1;
                out[r] = -1;
            } else {
                status[r] = 0;
                out[r] = best_i;
            }
        }
    }
}

static int need(Py_buffer *v, Py_ssize_t bytes, const char *name) {
    if (v->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes, need %zd", name, v->len, bytes);
        return 0;
    }
    return 1;
}

/* search(qa, operand, vectors, queries, offset, out, status, m, k1, vp, n_vocab, dim, limit) */
static PyObject *py_search(PyObject *self, PyObject *args) {
    Py_buffer qa, op, vecs, q, offset, out, status;
    Py_ssize_t m, k1, vp, n_vocab, dim;
    long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*w*nnnnnL", &qa, &op, &vecs, &q, &offset, &out, &status,
                          &m, &k1, &vp, &n_vocab, &dim, &limit))
        return NULL;
    PyObject *ret = NULL;
    float *bmin = NULL;
    if (m < 0 || k1 <= 0 || k1 > 64 || vp % LANES || n_vocab > vp || dim <= 0) {
        PyErr_SetString(PyExc_ValueError, "search: bad shapes");
        goto done;
    }
    if (!need(&qa, m * k1 * 4, "qa") || !need(&op, k1 * vp * 4, "operand") ||
        !need(&vecs, n_vocab * dim * 4, "vectors") || !need(&q, m * dim * 4, "queries") ||
        !need(&offset, m * 8, "offset") || !need(&out, m * 8, "out") || !need(&status, m, "status"))
        goto done;
    bmin = malloc(sizeof(float) * QT * ((vp + WB - 1) / WB + 1));
    if (!bmin) { PyErr_NoMemory(); goto done; }
    Py_BEGIN_ALLOW_THREADS
    search_block(qa.buf, (size_t)k1, op.buf, (size_t)vp, (size_t)n_vocab, vecs.buf, q.buf, (size_t)dim,
                 offset.buf, (int64_t)limit, (size_t)m, out.buf, status.buf, bmin);
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    free(bmin);
    PyBuffer_Release(&qa); PyBuffer_Release(&op); PyBuffer_Release(&vecs); PyBuffer_Release(&q);
    PyBuffer_Release(&offset); PyBuffer_Release(&out); PyBuffer_Release(&status);
    return ret;
}

static PyMethodDef methods[] = {
    {"search", py_search, METH_VARARGS,
     "Nearest words of a block of queries (see gaussdp.text.search); status 1 = decide in numpy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_search", NULL, -1, methods};

PyMODINIT_FUNC PyInit__search(void) { return PyModule_Create(&module); }
