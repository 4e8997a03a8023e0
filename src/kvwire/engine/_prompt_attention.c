/* kvwire.engine._prompt_attention: causal attention of whole prompts over their own K/V (float32).

   prompt(out, q, q_offset, q_row, k, k_offset, k_row, v, v_offset, v_row, starts, lens, tokens,
   num_heads, num_kv_heads, head_dim, scale) computes, for each sequence i (rows starts[i] ..
   starts[i] + lens[i] - 1 of the step's packed tokens), each of its rows t and each query head h
   (which reads KV head h // (num_heads / num_kv_heads)),
       out[t, h] = softmax(q[t, h] . K[s .. t]^T * scale) V[s .. t],   s = starts[i]
   q, k and v are flat float32 buffers: row t of q starts at q_offset + t * q_row floats and holds the
   heads one after another (head_dim floats each); likewise k and v. So the step's fused qkv
   projection is read where it lies, without a copy. out is [tokens, num_heads, head_dim]; rows of no
   listed sequence are left as they are. Head sizes 64 and 128 (prompt_dims).

   Why native: torch's CPU flash kernel runs one call per prompt at ~45 GFLOP/s for SmolLM2's 256-token
   prompts (docs/decisions/152-prompt-attention-kernel.md). Here K of one sequence and KV head is
   transposed once, so that a tile's 16 scores of eight query vectors (the rows x query heads sharing
   that KV head) accumulate in eight registers from one K load and eight broadcasts per element of
   head_dim; an online softmax per query vector (running maximum and sum) and the output in tiles of
   16 keys, key tiles above the diagonal skipped. A query vector's result depends on its own row, its
   sequence's K/V and its position only (its tiles start at the sequence's first token, whatever
   other vectors share its chunk), so a row does not depend on its batch. Sizes and ranges are checked
   before anything is computed (ValueError); the arithmetic runs without the GIL. */
#define PY_SSIZE_T_CLEAN
#pragma GCC diagnostic ignored "-Wpsabi" /* v16 only in ALWAYS_INLINE helpers: never passed in a call */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define KT 16 /* keys of a tile: one vector of scores */
#define NV 8  /* query vectors computed together */

#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__linux__)
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef KERNEL
#define KERNEL
#endif

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define VECTOR_PATH 1
typedef float v16 __attribute__((vector_size(64)));

ALWAYS_INLINE v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* s[i] = exp(s[i] - top), 0 below -87 (the decode kernel's branch-free polynomial: 2^n * e^r, e^r by
   its degree-6 Taylor polynomial, relative error under 2e-7). */
ALWAYS_INLINE void exp_shifted(float *restrict s, float top)
{
    for (int i = 0; i < KT; i++) {
        float x = s[i] - top, v = x < -87.0f ? -87.0f : x;
        float t = v * 1.44269504f + 12582912.0f;
        float n = t - 12582912.0f;
        float r = v - n * 0.693145751953125f - n * 1.428606765330187e-06f;
        float e = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f
                  + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
        int32_t bits;
        memcpy(&bits, &t, sizeof bits);
        bits = (bits - 0x4B400000 + 127) * (1 << 23);
        float two_n;
        memcpy(&two_n, &bits, sizeof two_n);
        s[i] = x < -87.0f ? 0.0f : e * two_n;
    }
}

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int64_t *starts, *lens;
    Py_ssize_t seqs, tokens, heads, kv_heads, dim, q_off, q_row, k_off, k_row, v_off, v_row;
    float scale;
} Prompt;

/* One query vector: its row of q, where its output goes, what it sees. */
typedef struct {
    const float *q;
    float *out;
    int64_t pos; /* its token's position in the sequence: it sees keys 0 .. pos */
} Query;

/* K rows of one sequence's KV head, transposed: kt[d * stride + t], zero past len. */
ALWAYS_INLINE void transpose_k(const float *k, Py_ssize_t row, int64_t len, Py_ssize_t stride, Py_ssize_t dim,
                               float *kt)
{
    for (Py_ssize_t d = 0; d < dim; d++)
        memset(kt + d * stride + len, 0, (size_t)(stride - len) * sizeof(float));
    for (int64_t t = 0; t < len; t++)
        for (Py_ssize_t d = 0; d < dim; d++)
            kt[d * stride + t] = k[t * row + d];
}

/* Softmax of one query vector's scores s[0 .. n) (masked ones -inf): exp(s - max) in place, summed
   in 16 lanes; returns 1 / the sum. */
ALWAYS_INLINE float softmax_row(float *restrict s, int64_t n)
{
    float top[KT], sum[KT];
    for (int j = 0; j < KT; j++)
        top[j] = -INFINITY, sum[j] = 0.0f;
    for (int64_t t = 0; t < n; t += KT)
        for (int j = 0; j < KT; j++)
            top[j] = s[t + j] > top[j] ? s[t + j] : top[j];
    float m = top[0];
    for (int j = 1; j < KT; j++)
        m = top[j] > m ? top[j] : m;
    for (int64_t t = 0; t < n; t += KT) {
        exp_shifted(s + t, m);
        for (int j = 0; j < KT; j++)
            sum[j] += s[t + j];
    }
    for (int w = KT / 2; w; w >>= 1)
        for (int j = 0; j < w; j++)
            sum[j] += sum[j + w];
    return sum[0] > 0.0f ? 1.0f / sum[0] : 0.0f;
}

/* NV query vectors of one KV head (K transposed in kt, V rows `row` floats apart from v) over keys
   0 .. the last any of them sees, in three passes: the scores (scaled, -inf past each vector's
   position) into s (NV rows of `stride` floats), their softmax, the weighted sum of V rows into the
   outputs. A vector's weights past its position are exact zeros, so what its chunk-mates see does not
   change its result. */
ALWAYS_INLINE void chunk(const Query *qs, const float *kt, Py_ssize_t stride, const float *v, Py_ssize_t row,
                         float scale, float *s, const int C)
{
    const Py_ssize_t dim = 16 * C;
    int64_t last = 0;
    for (int i = 0; i < NV; i++)
        last = qs[i].pos > last ? qs[i].pos : last;
    const int64_t n = (last + KT) / KT * KT; /* keys computed: whole tiles */
    for (int64_t k0 = 0; k0 < n; k0 += KT) {
        v16 sc[NV];
        for (int i = 0; i < NV; i++)
            sc[i] = (v16){0};
        for (Py_ssize_t d = 0; d < dim; d++) {
            const v16 kd = load16(kt + d * stride + k0);
            for (int i = 0; i < NV; i++)
                sc[i] += qs[i].q[d] * kd;
        }
        for (int i = 0; i < NV; i++) {
            const v16 scaled = sc[i] * scale;
            memcpy(s + i * stride + k0, &scaled, sizeof scaled);
            if (k0 + KT - 1 > qs[i].pos) /* the tile crosses or lies past the diagonal */
                for (int j = 0; j < KT; j++)
                    if (k0 + j > qs[i].pos)
                        s[i * stride + k0 + j] = -INFINITY;
        }
    }
    float inv[NV];
    for (int i = 0; i < NV; i++)
        inv[i] = softmax_row(s + i * stride, n);
    const int64_t keys = last + 1;
    for (int c = 0; c < C; c += 2) {
        v16 o[NV][2];
        for (int i = 0; i < NV; i++)
            o[i][0] = o[i][1] = (v16){0};
        for (int64_t j = 0; j < keys; j++) {
            const v16 v0 = load16(v + j * row + 16 * c), v1 = load16(v + j * row + 16 * c + 16);
            for (int i = 0; i < NV; i++) {
                const float p = s[i * stride + j];
                o[i][0] += p * v0;
                o[i][1] += p * v1;
            }
        }
        for (int i = 0; i < NV; i++) {
            const v16 a = o[i][0] * inv[i], b = o[i][1] * inv[i];
            memcpy(qs[i].out + 16 * c, &a, sizeof a);
            memcpy(qs[i].out + 16 * c + 16, &b, sizeof b);
        }
    }
}

/* One sequence, one KV head: its rows x query heads in chunks of NV query vectors (the last chunk
   padded by repeating its last vector, whose result is written to a scratch row). */
ALWAYS_INLINE void attend_head(const Prompt *pb, int64_t start, int64_t len, Py_ssize_t h, float *kt,
                               float *s, float *scratch, const int C)
{
    const Py_ssize_t dim = 16 * C, group = pb->heads / pb->kv_heads, stride = (len + KT - 1) / KT * KT;
    transpose_k(pb->k + pb->k_off + start * pb->k_row + h * dim, pb->k_row, len, stride, dim, kt);
    const float *v = pb->v + pb->v_off + start * pb->v_row + h * dim;
    const int64_t total = len * group;
    for (int64_t first = 0; first < total; first += NV) {
        Query qs[NV];
        for (int i = 0; i < NV; i++) {
            const int64_t n = first + i < total ? first + i : total - 1, t = n / group, g = n % group;
            const Py_ssize_t head = h * group + g;
            qs[i].q = pb->q + pb->q_off + (start + t) * pb->q_row + head * dim;
            qs[i].out = first + i < total ? pb->out + ((start + t) * pb->heads + head) * dim : scratch;
            qs[i].pos = t;
        }
        chunk(qs, kt, stride, v, pb->v_row, pb->scale, s, C);
    }
}

KERNEL static void attend_prompts(const Prompt *pb, float *kt, float *s, float *scratch)
{
    for (Py_ssize_t i = 0; i < pb->seqs; i++)
        for (Py_ssize_t h = 0; h < pb->kv_heads; h++) {
            if (pb->dim == 64)
                attend_head(pb, pb->starts[i], pb->lens[i], h, kt, s, scratch, 4);
            else
                attend_head(pb, pb->starts[i], pb->lens[i], h, kt, s, scratch, 8);
        }
}
#else
#define VECTOR_PATH 0
#endif

/* A flat buffer of `len` bytes holds rows 0 .. tokens - 1 of `width` floats from `off`, `row` apart. */
static int rows_fit(const Py_buffer *buf, Py_ssize_t off, Py_ssize_t row, Py_ssize_t tokens, Py_ssize_t width)
{
    const Py_ssize_t floats = buf->len / (Py_ssize_t)sizeof(float);
    if (off < 0 || width < 1 || row < width || tokens < 1 || off > floats)
        return 0;
    return (tokens - 1) <= (floats - off - width) / row && floats - off >= width;
}

/* Every size and range checked; 0 = fine, -1 = ValueError set. */
static int check(const Prompt *pb, const Py_buffer *out, const Py_buffer *q, const Py_buffer *k,
                 const Py_buffer *v)
{
    if (!VECTOR_PATH || (pb->dim != 64 && pb->dim != 128)) {
        PyErr_Format(PyExc_ValueError, "head size %zd: the kernel takes 64 and 128", pb->dim);
        return -1;
    }
    if (pb->kv_heads < 1 || pb->heads % pb->kv_heads != 0) {
        PyErr_Format(PyExc_ValueError, "%zd query heads over %zd KV heads", pb->heads, pb->kv_heads);
        return -1;
    }
    const Py_ssize_t width = pb->heads * pb->dim;
    if (pb->tokens < 1 || width > PY_SSIZE_T_MAX / pb->tokens
        || out->len != pb->tokens * width * (Py_ssize_t)sizeof(float)
        || !rows_fit(q, pb->q_off, pb->q_row, pb->tokens, width)
        || !rows_fit(k, pb->k_off, pb->k_row, pb->tokens, pb->kv_heads * pb->dim)
        || !rows_fit(v, pb->v_off, pb->v_row, pb->tokens, pb->kv_heads * pb->dim)) {
        PyErr_Format(PyExc_ValueError, "buffers disagree with %zd tokens of %zd heads of %zd (%zd KV heads)",
                     pb->tokens, pb->heads, pb->dim, pb->kv_heads);
        return -1;
    }
    for (Py_ssize_t i = 0; i < pb->seqs; i++)
        if (pb->starts[i] < 0 || pb->lens[i] < 1 || pb->starts[i] > pb->tokens - pb->lens[i]) {
            PyErr_Format(PyExc_ValueError, "sequence %zd: rows %lld + %lld outside 0..%zd", i,
                         (long long)pb->starts[i], (long long)pb->lens[i], pb->tokens);
            return -1;
        }
    return 0;
}

static PyObject *prompt(PyObject *self, PyObject *args)
{
    Py_buffer out, q, k, v, starts, lens;
    Prompt pb = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*nny*nny*nny*y*nnnnf:prompt", &out, &q, &pb.q_off, &pb.q_row, &k, &pb.k_off,
                          &pb.k_row, &v, &pb.v_off, &pb.v_row, &starts, &lens, &pb.tokens, &pb.heads, &pb.kv_heads,
                          &pb.dim, &pb.scale))
        return NULL;
    PyObject *result = NULL;
    float *work = NULL;
    pb.q = q.buf, pb.k = k.buf, pb.v = v.buf, pb.out = out.buf, pb.starts = starts.buf, pb.lens = lens.buf;
    pb.seqs = lens.len / (Py_ssize_t)sizeof(int64_t);
    if (pb.seqs < 1 || lens.len % (Py_ssize_t)sizeof(int64_t) != 0 || starts.len != lens.len) {
        PyErr_Format(PyExc_ValueError, "starts (%zd B) and lens (%zd B): one int64 or more each, as many",
                     starts.len, lens.len);
        goto done;
    }
    if (check(&pb, &out, &q, &k, &v) < 0)
        goto done;
    int64_t longest = 0;
    for (Py_ssize_t i = 0; i < pb.seqs; i++)
        longest = pb.lens[i] > longest ? pb.lens[i] : longest;
    const size_t stride = (size_t)(longest + KT - 1) / KT * KT;
    /* K transposed (stride x dim), the scores (NV x stride), a scratch output row (dim) */
    work = malloc((stride * (size_t)(pb.dim + NV) + (size_t)pb.dim) * sizeof(float));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
#if VECTOR_PATH
    Py_BEGIN_ALLOW_THREADS
    attend_prompts(&pb, work, work + stride * (size_t)pb.dim, work + stride * (size_t)(pb.dim + NV));
    Py_END_ALLOW_THREADS
#endif
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(work);
    PyBuffer_Release(&out);
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lens);
    return result;
}

static PyMethodDef methods[] = {
    {"prompt", prompt, METH_VARARGS,
     "prompt(out, q, q_offset, q_row, k, k_offset, k_row, v, v_offset, v_row, starts, lens, tokens, num_heads, "
     "num_kv_heads, head_dim, scale): causal attention of whole prompts over their own K/V (float32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prompt_attention", "Causal attention of whole prompts over their own K/V.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__prompt_attention(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddObject(mod, "prompt_dims", VECTOR_PATH ? Py_BuildValue("(ii)", 64, 128)
                                                                            : PyTuple_New(0)) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
