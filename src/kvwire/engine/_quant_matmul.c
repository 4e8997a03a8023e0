/* kvwire.engine._quant_matmul: y = x W^T for weight-only int8 and int4 weights, few rows of x.

   mm8(out, x, packed, scale, rows, n, k) computes, for every row m < rows and output j < n,
       out[m, j] = scale[j] * sum_i bf16(x[m, i]) * q[j, i]
   with x [rows, k] float32 (rounded to bfloat16 here, to nearest even, as torch's cast does), out
   [rows, n] float32, scale [n] float32 and the weight codes q (int8, -127..127) in the tiled layout
   that kvwire.engine.quant.pack_int8 writes: tiles of 16 output rows (n rounded up to 16, the padding
   rows zero), each tile [k / 2, 16, 2]: for every pair of inputs (2p, 2p + 1), the 16 rows' two codes
   side by side (32 bytes). k must be even.

   mm4(out, x, codes, scales_zeros, rows, n, k) computes the same for int4 codes q (0..15) in groups
   of 32 inputs, w = (q - 8) * scale + zero (torch's int4 convention), laid out by
   kvwire.engine.quant.pack_int4: tiles of 16 rows, each [k / 2, 16] bytes (the row's even input in
   the low nibble), and the bfloat16 scales and zeros [tiles, k / 32, 2, 16]. k a multiple of 32.

   Every buffer is C-contiguous; sizes are checked against the shape before anything is computed
   (ValueError); the arithmetic runs without the GIL.

   How: the codes of a tile and input pair become 32 bfloat16 values (exact: |q| <= 127; int4 codes
   as 128 + q, the offset taken back per group with the group's sum of x), and one VDPBF16PS per row
   adds the 16 rows' pair products into float32 accumulators (a row's input pair is broadcast from
   memory). The codes are widened once per tile and pair for up to 8 rows at a time (int8: two tiles
   walked together, 16 independent accumulators), and the codes 2 KiB (int4: 4 KiB) ahead are
   prefetched. Each accumulator adds its pairs in input order from zero, whatever the number of rows
   and tiles walked with it: a row's result does not depend on the batch it is in (P/D output equals
   colocated).

   Why native: torch's _weight_int8pack_mm and _weight_int4pack_mm_for_cpu widen the codes again for
   every few rows of the batch; at 8 rows they took ~15 ms (int8) and ~11 ms (int4) of a ~25 ms decode
   step of SmolLM2 on the 2-core box (docs/decisions/157-quantized-decode-gemm.md). Needs AVX512-BF16;
   supported() says whether this CPU has it (torch runs otherwise, and in processes of several torch
   threads: this kernel is single-threaded). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16     /* output rows of one tile: one register of float32 accumulators */
#define ROWS 8      /* batch rows sharing one widening of the codes */
#ifndef PF_DIST
#define PF_DIST 2048 /* bytes ahead in each tile's int8 codes fetched into L1 (decision 157's table) */
#endif
#ifndef PF_DIST4
#define PF_DIST4 4096 /* the same for int4 codes (half the bytes a pair) */
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

/* int4: 32 codes (16 rows x an input pair, a byte per row: low nibble the even input) as the bfloat16
   values 128 + q (exact: the exponent of 128 and q in the mantissa's low bits) */
TARGET ALWAYS_INLINE __m512bh nibbles(const uint8_t *w, __m512i high_half, __m512i bias)
{
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    /* low 16 bits from d (q0 | q1 << 4), high 16 from d << 12 (q1 in bits 16..19) */
    const __m512i u = _mm512_ternarylogic_epi32(high_half, d, _mm512_slli_epi32(d, 12), 0xAC); /* a ? c : b */
    return (__m512bh)_mm512_ternarylogic_epi32(u, _mm512_set1_epi32(0x000F000F), bias, 0xEA); /* u & m | b */
}

TARGET ALWAYS_INLINE __m512 bf16_to_ps(const uint16_t *v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)v)), 16));
}

/* one tile of 16 output rows for `mr` batch rows; per group of 32 inputs: the products of the codes
   (as 128 + q) summed from zero, times the group's scale, plus (zero - 136 scale) times the group's
   sum of x: w = (q - 8) scale + zero */
TARGET ALWAYS_INLINE void block4(const uint8_t *w, const uint16_t *sz, const uint32_t *xb, const float *xsum,
                                 Py_ssize_t pairs, float *out, Py_ssize_t n, Py_ssize_t j, int mr)
{
    const Py_ssize_t groups = pairs / 16;
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u), bias = _mm512_set1_epi32(0x43004300);
    __m512 acc[ROWS];
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps();
    for (Py_ssize_t g = 0; g < groups; g++) {
        __m512 part[ROWS];
        for (int r = 0; r < mr; r++)
            part[r] = _mm512_setzero_ps();
        for (Py_ssize_t p = g * 16; p < g * 16 + 16; p++) {
#if PF_DIST4 > 0
            if ((p & 3) == 0)
                _mm_prefetch((const char *)(w + 16 * p + PF_DIST4), PF_HINT);
#endif
            const __m512bh wv = nibbles(w + 16 * p, high_half, bias);
            for (int r = 0; r < mr; r++)
                part[r] = _mm512_dpbf16_ps(part[r], wv, (__m512bh)_mm512_set1_epi32((int)xb[r * pairs + p]));
        }
        const __m512 scale = bf16_to_ps(sz + g * 32), zero = bf16_to_ps(sz + g * 32 + 16);
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero);
        for (int r = 0; r < mr; r++) {
            acc[r] = _mm512_fmadd_ps(part[r], scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), offset, acc[r]);
        }
    }
    const Py_ssize_t left = n - j;
    const __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(out + r * n + j, keep, acc[r]);
}

#define BLOCK4_CASE(R)                                                                               \
    case R:                                                                                          \
        block4(w, sz, xb, xsum, pairs, out, n, j, R);                                                \
        break;

TARGET static void tile_rows4(const uint8_t *w, const uint16_t *sz, const uint32_t *xb, const float *xsum,
                              Py_ssize_t pairs, float *out, Py_ssize_t n, Py_ssize_t j, int mr)
{
    switch (mr) {
        BLOCK4_CASE(1) BLOCK4_CASE(2) BLOCK4_CASE(3) BLOCK4_CASE(4) BLOCK4_CASE(5) BLOCK4_CASE(6)
        BLOCK4_CASE(7) BLOCK4_CASE(8) default : break;
    }
}

/* the sum of each group of 32 bfloat16 inputs, as float32, in a fixed order */
TARGET static void group_sums(const uint32_t *xb, float *xsum, Py_ssize_t count)
{
    const uint16_t *v = (const uint16_t *)xb;
    for (Py_ssize_t g = 0; g < count / 32; g++)
        xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16_to_ps(v + 32 * g), bf16_to_ps(v + 32 * g + 16)));
}

TARGET static void matmul4(float *out, const float *x, const uint8_t *codes, const uint16_t *sz, uint32_t *xb,
                           float *xsum, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t k)
{
    const Py_ssize_t pairs = k / 2, tile_bytes = (Py_ssize_t)TILE * pairs, ntiles = (n + TILE - 1) / TILE;
    to_bf16(x, xb, rows * k);
    group_sums(xb, xsum, rows * k);
    for (Py_ssize_t t = 0; t < ntiles; t++)
        for (Py_ssize_t m = 0; m < rows; m += ROWS) {
            const int mr = rows - m >= ROWS ? ROWS : (int)(rows - m);
            tile_rows4(codes + t * tile_bytes, sz + t * (k / 32) * 32, xb + m * pairs, xsum + m * (k / 32),
                       pairs, out + m * n, n, t * TILE, mr);
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

/* Both kernels' shape: positive sizes, k a multiple of `multiple` (so at least that), and products
   small enough that no size below overflows; `need` says what k must be. */
static int check_shape(Py_ssize_t rows, Py_ssize_t n, Py_ssize_t k, Py_ssize_t multiple, const char *need)
{
    const Py_ssize_t cap = (Py_ssize_t)1 << 40;
    if (rows < 1 || n < 1 || k < multiple || k % multiple != 0 || rows > cap / k || n > cap / k || rows > cap / n) {
        PyErr_Format(PyExc_ValueError, "shape %zd x %zd x %zd: needs positive sizes and %s", rows, n, k, need);
        return -1;
    }
    return 0;
}

static int check_cpu(void)
{
    if (!cpu_has_bf16()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU (or this build) has no AVX512-BF16");
        return -1;
    }
    return 0;
}

/* The buffers' sizes against the shape: float32 out and x, `codes` and `aux` (int8: the per-row scales;
   int4: the groups' bfloat16 scales and zeros) as the kernel of `int4` packs them. */
static int check(const Py_buffer *out, const Py_buffer *x, const Py_buffer *codes, const Py_buffer *aux,
                 Py_ssize_t rows, Py_ssize_t n, Py_ssize_t k, int int4)
{
    const Py_ssize_t f = (Py_ssize_t)sizeof(float);
    if (check_shape(rows, n, k, int4 ? 32 : 2, int4 ? "k a multiple of 32" : "an even k") < 0)
        return -1;
    const Py_ssize_t tiles = (n + TILE - 1) / TILE;
    const Py_ssize_t codes_len = int4 ? tiles * TILE * k / 2 : tiles * TILE * k;
    const Py_ssize_t aux_len = int4 ? tiles * (k / 32) * 2 * TILE * 2 : n * f;
    if (out->len != rows * n * f || x->len != rows * k * f || codes->len != codes_len || aux->len != aux_len) {
        PyErr_Format(PyExc_ValueError,
                     "buffer sizes disagree with the shape %zd x %zd x %zd: out %zd B, x %zd B, codes %zd B, "
                     "%s %zd B",
                     rows, n, k, out->len, x->len, codes->len, int4 ? "scales and zeros" : "scale", aux->len);
        return -1;
    }
    return check_cpu();
}

/* mm8 and mm4: parse, check, convert x to bfloat16 in a scratch buffer (int4: with each group's sum of
   x after it), multiply without the GIL. */
static PyObject *run(PyObject *args, const char *format, int int4)
{
    Py_buffer out, x, codes, aux;
    Py_ssize_t rows, n, k;
    if (!PyArg_ParseTuple(args, format, &out, &x, &codes, &aux, &rows, &n, &k))
        return NULL;
    PyObject *result = NULL;
    uint32_t *xb = NULL;
    if (check(&out, &x, &codes, &aux, rows, n, k, int4) < 0)
        goto done;
    const size_t sums = int4 ? (size_t)(rows * k / 32) * sizeof(float) : 0;
    xb = malloc((size_t)(rows * k) * sizeof(uint16_t) + sums + 64);
    if (xb == NULL) {
        PyErr_NoMemory();
        goto done;
    }
#if HAVE_BF16
    Py_BEGIN_ALLOW_THREADS
    if (int4)
        matmul4(out.buf, x.buf, codes.buf, aux.buf, xb, (float *)(xb + rows * k / 2), rows, n, k);
    else
        matmul(out.buf, x.buf, codes.buf, aux.buf, xb, rows, n, k);
    Py_END_ALLOW_THREADS
#endif
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(xb);
    PyBuffer_Release(&out);
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&aux);
    return result;
}

static PyObject *mm8(PyObject *self, PyObject *args)
{
    (void)self;
    return run(args, "w*y*y*y*nnn:mm8", 0);
}

static PyObject *mm4(PyObject *self, PyObject *args)
{
    (void)self;
    return run(args, "w*y*y*y*nnn:mm4", 1);
}

static PyMethodDef methods[] = {
    {"mm4", mm4, METH_VARARGS,
     "mm4(out, x, codes, scales_zeros, rows, n, k): out = bf16(x) . W^T for int4 codes in groups of 32 inputs, "
     "w = (q - 8) scale + zero, in tiles of 16 output rows (float32 x and out; bfloat16 scales and zeros)."},
    {"supported", supported, METH_NOARGS, "supported(): True when this CPU and build run mm (AVX512-BF16)."},
    {"mm8", mm8, METH_VARARGS,
     "mm8(out, x, packed, scale, rows, n, k): out = (bf16(x) . codes^T) * scale for int8 codes in tiles of 16 "
     "output rows (float32 x, out, scale)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_quant_matmul", "Weight-only int8 and int4 matrix products for few rows (AVX512-BF16).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__quant_matmul(void)
{
    return PyModule_Create(&module);
}
