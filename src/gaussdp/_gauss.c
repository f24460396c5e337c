/* gaussdp._gauss: standard normal deviates from uniform random words, in place, vectorised.
 *
 * The words come from a cryptographic keystream (gaussdp.torch._random: AES-128-CTR from OpenSSL);
 * this file only maps them to N(0, 1) by the Box-Muller transform:
 *     Z1 = sqrt(-2 ln U1) cos(2 pi U2),   Z2 = sqrt(-2 ln U1) sin(2 pi U2).
 * Each block of 2m words becomes 2m deviates: word i (U1) and word m + i (U2) give outputs i and
 * m + i. The block is copied out first, so the transform may overwrite its own input; normal_add
 * adds the deviates to another buffer instead (one pass over it, no array of deviates).
 *
 * float32: U1 = (w + 1/2) 2^-32 from a whole 32-bit word (0 < U1 <= 1, so the radius reaches
 * sqrt(2 ln 2^33) = 6.76 sigma), U2 from the top 24 bits. float64: 53-bit U1 and U2 from 64-bit
 * words (radius up to 8.7 sigma). The deviates are float approximations of the Gaussian, like every
 * floating-point sampler (torch's own uses 24-bit uniforms and stops at 5.8 sigma).
 *
 * Speed: compiled with -O3 -ffast-math so that GCC calls glibc's vector math (libmvec) for log,
 * sin and cos, with clones for AVX-512, AVX2 and plain x86-64 picked at load time. -ffast-math is
 * a compile flag only: the module is linked without it, so crtfastmath.o (which would switch the
 * whole process to flush-to-zero) is not linked in; tests/torch/test_fast_noise.py checks this.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 512 /* pairs per block: 4 KiB of float32 words on the stack */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* Deviates from the 2m words at `words` (copied first: z may be the words themselves), written to
 * z[0 .. 2m) or, with add, added to it. */
CLONES static void block_f32(const void *words, size_t m, float scale, float *restrict z, int add) {
    uint32_t w[2 * BLOCK];
    float r[BLOCK], t[BLOCK];
    memcpy(w, words, 2 * m * sizeof(uint32_t));
    for (size_t i = 0; i < m; i++) {
        float u1 = ((float)w[i] + 0.5f) * 0x1p-32f; /* rounds to 1.0 at worst: radius 0 */
        float v = -2.0f * logf(u1);
        r[i] = scale * sqrtf(v > 0.0f ? v : 0.0f);
        t[i] = 6.2831853071795864769f * ((float)(w[m + i] >> 8) * 0x1p-24f);
    }
    /* separate loops: GCC fuses sin and cos of one angle into sincos, which it cannot vectorise */
    if (add) { /* a loop-invariant test: GCC makes two versions of the loops */
        for (size_t i = 0; i < m; i++) z[i] += r[i] * cosf(t[i]);
        for (size_t i = 0; i < m; i++) z[m + i] += r[i] * sinf(t[i]);
    } else {
        for (size_t i = 0; i < m; i++) z[i] = r[i] * cosf(t[i]);
        for (size_t i = 0; i < m; i++) z[m + i] = r[i] * sinf(t[i]);
    }
}

CLONES static void block_f64(const void *words, size_t m, double scale, double *restrict z, int add) {
    uint64_t w[2 * BLOCK];
    double r[BLOCK], t[BLOCK];
    memcpy(w, words, 2 * m * sizeof(uint64_t));
    for (size_t i = 0; i < m; i++) {
        double u1 = ((double)(int64_t)(w[i] >> 11) + 0.5) * 0x1p-53;
        double v = -2.0 * log(u1);
        r[i] = scale * sqrt(v > 0.0 ? v : 0.0);
        t[i] = 6.2831853071795864769 * ((double)(int64_t)(w[m + i] >> 11) * 0x1p-53);
    }
    if (add) { /* a loop-invariant test: GCC makes two versions of the loops */
        for (size_t i = 0; i < m; i++) z[i] += r[i] * cos(t[i]);
        for (size_t i = 0; i < m; i++) z[m + i] += r[i] * sin(t[i]);
    } else {
        for (size_t i = 0; i < m; i++) z[i] = r[i] * cos(t[i]);
        for (size_t i = 0; i < m; i++) z[m + i] = r[i] * sin(t[i]);
    }
}

/* Deviates from the words in `src` (n_words of them, even), written over them (dst == NULL) or
 * added to the first n_dst values of `dst` (n_dst <= n_words: a last, odd deviate is dropped). */
static void transform(void *src, size_t n_words, void *dst, size_t n_dst, int itemsize, double scale) {
    for (size_t lo = 0; lo < n_words; lo += 2 * BLOCK) {
        size_t m = (n_words - lo < 2 * BLOCK ? n_words - lo : 2 * BLOCK) / 2;
        int whole = dst == NULL || lo + 2 * m <= n_dst; /* else the last pair, one value dropped */
        if (itemsize == 4) {
            float z[2 * BLOCK];
            float *out = dst == NULL ? (float *)src + lo : whole ? (float *)dst + lo : z;
            block_f32((uint32_t *)src + lo, m, (float)scale, out, dst != NULL && whole);
            if (!whole)
                for (size_t i = 0; lo + i < n_dst; i++) ((float *)dst)[lo + i] += z[i];
        } else {
            double z[2 * BLOCK];
            double *out = dst == NULL ? (double *)src + lo : whole ? (double *)dst + lo : z;
            block_f64((uint64_t *)src + lo, m, scale, out, dst != NULL && whole);
            if (!whole)
                for (size_t i = 0; lo + i < n_dst; i++) ((double *)dst)[lo + i] += z[i];
        }
    }
}

static int check_words(Py_buffer *view, int itemsize) {
    if (itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 4 (float32) or 8 (float64), got %d", itemsize);
        return -1;
    }
    if (view->len % (2 * itemsize) != 0) {
        PyErr_Format(PyExc_ValueError, "words must be an even number of %d-byte words, got %zd bytes",
                     itemsize, view->len);
        return -1;
    }
    if ((uintptr_t)view->buf % (uintptr_t)itemsize != 0) {
        PyErr_SetString(PyExc_ValueError, "buffer is not aligned to its item size");
        return -1;
    }
    return 0;
}

static PyObject *normal_inplace(PyObject *self, PyObject *args) {
    Py_buffer view;
    int itemsize;
    double scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*id", &view, &itemsize, &scale)) return NULL;
    if (check_words(&view, itemsize) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t n = (size_t)view.len / (size_t)itemsize;
    Py_BEGIN_ALLOW_THREADS
    transform(view.buf, n, NULL, 0, itemsize, scale);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *normal_add(PyObject *self, PyObject *args) {
    Py_buffer dst, words;
    int itemsize;
    double scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*id", &dst, &words, &itemsize, &scale)) return NULL;
    PyObject *result = NULL;
    if (check_words(&words, itemsize) == 0) {
        if (dst.len % itemsize != 0 || (uintptr_t)dst.buf % (uintptr_t)itemsize != 0) {
            PyErr_Format(PyExc_ValueError, "dst must be aligned %d-byte values", itemsize);
        } else if (dst.len > words.len || words.len - dst.len >= 2 * itemsize) {
            PyErr_Format(PyExc_ValueError, "dst holds %zd bytes: words must be as long, rounded up to a pair",
                         dst.len);
        } else if ((char *)dst.buf < (char *)words.buf + words.len &&
                   (char *)words.buf < (char *)dst.buf + dst.len) {
            PyErr_SetString(PyExc_ValueError, "dst and words overlap");
        } else {
            Py_BEGIN_ALLOW_THREADS
            transform(words.buf, (size_t)words.len / (size_t)itemsize, dst.buf,
                      (size_t)dst.len / (size_t)itemsize, itemsize, scale);
            Py_END_ALLOW_THREADS
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    /* callers check that scale is finite: under -ffast-math isfinite() may be folded to true */
    {"normal_inplace", normal_inplace, METH_VARARGS,
     "normal_inplace(buffer, itemsize, scale): replace the buffer's uniform random words (4 or 8 "
     "bytes each, an even number) by scale * N(0, 1) deviates of that width (Box-Muller)."},
    {"normal_add", normal_add, METH_VARARGS,
     "normal_add(dst, words, itemsize, scale): dst += scale * N(0, 1), the deviates made from words "
     "(as in normal_inplace; len(dst) <= len(words) < len(dst) + 2 values, a last odd deviate dropped)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gauss", NULL, -1, methods};

PyMODINIT_FUNC PyInit__gauss(void) { return PyModule_Create(&module); }
