/* kvwire.engine._int8_matmul: y = x W^T for int8 weights with one scale per output row, few rows.

   mm(out, x, packed, scale, rows, n, k) computes, for every row m < rows and output j < n,
       out[m, j] = scale[j] * sum_i bf16(x[m, i]) * q[j, i]
   with x [rows, k] float32 (rounded to bfloat16 here, to nearest even, as torch's cast does), out
   [rows, n] float32, scale [n] float32 and the weight codes q (int8, -127..127) in the tiled layout
   that kvwire.engine.quant.pack_int8 writes: tiles of 16 output rows (n rounded up to 16, the padding
   rows zero), each tile [k / 2, 16, 2]: for every pair of inputs (2p, 2p + 1), the 16 rows' two codes
   side by side (32 bytes). k must be even. Every buffer is C-contiguous; sizes are checked against
   the shape before anything is computed (ValueError); the arithmetic runs without the GIL.

   How: the codes of a tile and input pair become 32 bfloat16 values (exact: |q| <= 127), and one
   VDPBF16PS per row adds the 16 rows' pair products into float32 accumulators (a row's input pair is
   broadcast from memory). The codes are widened once per tile and pair for up to 8 rows at a time, and
   two tiles are walked together: 16 independent accumulators. Each accumulator adds its pairs in input
   order from zero, whatever the number of rows and tiles walked with it: a row's result does not
   depend on the batch it is in (P/D output equals colocated).

   Why native: torch's _weight_int8pack_mm widens the codes to float32 once per row of the batch; at
   8 rows it took ~15 ms of a ~27 ms decode step of SmolLM2 on the 2-core box
   (docs/decisions/157-int8-decode-gemm.md). Needs AVX512-BF16; supported() says whether this CPU
   has it (torch runs otherwise). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16     /* output rows of one tile: one register of float32 accumulators */
#define ROWS 8      /* batch rows sharing one widening of the codes */
#ifndef PF_DIST
#define PF_DIST 2048 /* bytes ahead in each tile's codes fetched into L1 (decision 157's table) */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define HAVE_BF16 1
#include <immintrin.h>
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 32 codes (16 rows x an input pair) as 32 bfloat16 values, in the same order */
TARGET ALWAYS_INLINE __m512bh widen(const int8_t *w)
{
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* `tiles` (1 or 2) tiles of output rows for `mr` (1..ROWS) batch rows; constants after inlining */
TARGET ALWAYS_INLINE void block(const int8_t *w, Py_ssize_t tile_bytes, const uint32_t *xb, Py_ssize_t pairs,
                                const float *scale, float *out, Py_ssize_t n, Py_ssize_t j0, int tiles,
                                int mr)
{
    __m512 acc[2][ROWS];
    for (int t = 0; t < tiles; t++)
        for (int r = 0; r < mr; r++)
            acc[t][r] = _mm512_setzero_ps();
    for (Py_ssize_t p = 0; p < pairs; p++) {
        __m512bh wv[2];
#if PF_DIST > 0
        if ((p & 1) == 0)
            for (int t = 0; t < tiles; t++)
                _mm_prefetch((const char *)(w + t * tile_bytes + 32 * p + PF_DIST), PF_HINT);
#endif
        for (int t = 0; t < tiles; t++)
            wv[t] = widen(w + t * tile_bytes + 32 * p);
        for (int r = 0; r < mr; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[r * pairs + p]);
            for (int t = 0; t < tiles; t++)
                acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wv[t], xv);
        }
    }
    for (int t = 0; t < tiles; t++) {
        const Py_ssize_t j = j0 + t * TILE, left = n - j;
        const __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 s = _mm512_maskz_loadu_ps(keep, scale + j);
        for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(out + r * n + j, keep, _mm512_mul_ps(acc[t][r], s));
    }
}

#define BLOCK_CASE(T, R)                                                                             \
    case R:                                                                                          \
        block(w, tile_bytes, xb, pairs, scale, out, n, j0, T, R);                                    \
        break;
#define BLOCK_SWITCH(T)                                                                              \
    switch (mr) {                                                                                    \
        BLOCK_CASE(T, 1) BLOCK_CASE(T, 2) BLOCK_CASE(T, 3) BLOCK_CASE(T, 4) BLOCK_CASE(T, 5)         \
        BLOCK_CASE(T, 6) BLOCK_CASE(T, 7) BLOCK_CASE(T, 8) default : break;                          \
    }

TARGET static void tiles_rows(const int8_t *w, Py_ssize_t tile_bytes, const uint32_t *xb, Py_ssize_t pairs,
                              const float *scale, float *out, Py_ssize_t n, Py_ssize_t j0, int tiles, int mr)
{
    if (tiles == 2) {
        BLOCK_SWITCH(2)
    } else {
        BLOCK_SWITCH(1)
    }
}

/* x rounded to bfloat16, two inputs per 32-bit word (the lower one in the low half) */
TARGET static void to_bf16(const float *x, uint32_t *xb, Py_ssize_t count)
{
    Py_ssize_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < count) {
        const __mmask16 keep = (__mmask16)((1u << (count - i)) - 1u);
        const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, x + i));
        _mm256_mask_storeu_epi16((uint16_t *)xb + i, keep, v);
    }
}

TARGET static void matmul(float *out, const float *x, const int8_t *packed, const float *scale, uint32_t *xb,
                          Py_ssize_t rows, Py_ssize_t n, Py_ssize_t k)
{
    const Py_ssize_t pairs = k / 2, tile_bytes = (Py_ssize_t)TILE * k, ntiles = (n + TILE - 1) / TILE;
    to_bf16(x, xb, rows * k);
    for (Py_ssize_t t = 0; t < ntiles; t += 2) {
        const int tiles = ntiles - t >= 2 ? 2 : 1;
        for (Py_ssize_t m = 0; m < rows; m += ROWS) {
            const int mr = rows - m >= ROWS ? ROWS : (int)(rows - m);
            tiles_rows(packed + t * tile_bytes, tile_bytes, xb + m * pairs, pairs, scale, out + m * n, n, t * TILE,
                       tiles, mr);
        }
    }
}

static int cpu_has_bf16(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
#else
#define HAVE_BF16 0
static int cpu_has_bf16(void)
{
    return 0;
}
#endif

static PyObject *supported(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(cpu_has_bf16());
}

static int check(const Py_buffer *out, const Py_buffer *x, const Py_buffer *packed, const Py_buffer *scale,
                 Py_ssize_t rows, Py_ssize_t n, Py_ssize_t k)
{
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), cap = (Py_ssize_t)1 << 40;
    if (rows < 1 || n < 1 || k < 2 || k % 2 != 0 || rows > cap / k || n > cap / k || rows > cap / n) {
        PyErr_Format(PyExc_ValueError, "shape %zd x %zd x %zd: needs positive sizes and an even k", rows, n, k);
        return -1;
    }
    const Py_ssize_t padded = (n + TILE - 1) / TILE * TILE;
    if (out->len != rows * n * f || x->len != rows * k * f || packed->len != padded * k || scale->len != n * f) {
        PyErr_Format(PyExc_ValueError,
                     "buffer sizes disagree with the shape %zd x %zd x %zd: out %zd B, x %zd B, codes %zd B, "
                     "scale %zd B",
                     rows, n, k, out->len, x->len, packed->len, scale->len);
        return -1;
    }
    if (!cpu_has_bf16()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU (or this build) has no AVX512-BF16");
        return -1;
    }
    return 0;
}

static PyObject *mm(PyObject *self, PyObject *args)
{
    Py_buffer out, x, packed, scale;
    Py_ssize_t rows, n, k;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*nnn:mm", &out, &x, &packed, &scale, &rows, &n, &k))
        return NULL;
    PyObject *result = NULL;
    uint32_t *xb = NULL;
    if (check(&out, &x, &packed, &scale, rows, n, k) < 0)
        goto done;
    xb = malloc((size_t)(rows * k) * sizeof(uint16_t) + 64);
    if (xb == NULL) {
        PyErr_NoMemory();
        goto done;
    }
#if HAVE_BF16
    Py_BEGIN_ALLOW_THREADS
    matmul(out.buf, x.buf, packed.buf, scale.buf, xb, rows, n, k);
    Py_END_ALLOW_THREADS
#endif
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(xb);
    PyBuffer_Release(&out);
    PyBuffer_Release(&x);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&scale);
    return result;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "supported(): True when this CPU and build run mm (AVX512-BF16)."},
    {"mm", mm, METH_VARARGS,
     "mm(out, x, packed, scale, rows, n, k): out = (bf16(x) . codes^T) * scale for int8 codes in tiles of 16 "
     "output rows (float32 x, out, scale)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_int8_matmul", "Weight-only int8 matrix products for few rows (AVX512-BF16).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__int8_matmul(void)
{
    return PyModule_Create(&module);
}
