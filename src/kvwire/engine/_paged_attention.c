/* kvwire.engine._paged_attention: decode attention over the paged KV cache, read in place.

   decode(out, q, kv, block_tables, seq_lens, num_blocks, block_size, num_kv_heads, num_heads, head_dim,
   scale) computes, for each sequence b and query head h (which reads KV head h // (num_heads /
   num_kv_heads)),
       out[b, h] = softmax(q[b, h] . K[b, :L]^T * scale) V[b, :L],   L = seq_lens[b]
   where token t of sequence b lives at slot t % block_size of block block_tables[b, t // block_size]
   of ``kv`` (one layer's cache, [2, num_blocks, block_size, num_kv_heads, head_dim] float32, K then
   V). q and out are [B, Hq, head_dim] float32, block_tables [B, max_blocks] int64, seq_lens [B]
   int64; every buffer C-contiguous. One pass over each sequence's blocks with an online softmax
   (a running maximum and sum per query head, tiles of at most TILE tokens): no gathered copy of the
   KV, the query heads of a KV head share each K and V row read. Every size, length and block id is
   checked before anything is computed (ValueError); the arithmetic runs without the GIL.

   Why native: torch gathers the blocks into a contiguous buffer, then runs SDPA over it, reading
   and writing the KV twice more than it needs to; at batch 8 on the CPU the two took about a third
   of a decode step (docs/decisions/148-paged-decode-attention-kernel.md). */
#define PY_SSIZE_T_CLEAN
#pragma GCC diagnostic ignored "-Wpsabi" /* v16 only in ALWAYS_INLINE helpers: never passed in a call */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TILE 32   /* tokens whose scores are held at once */
#define LANES 16  /* partial sums of a dot product (one AVX-512 register of floats) */

/* One clone per instruction set, chosen at load (ifunc): the loops below are written so that the
   compiler vectorizes them (fixed-width lanes, no reassociation needed). */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__linux__)
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef KERNEL
#define KERNEL
#endif

ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, Py_ssize_t n)
{
    float acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += a[i + l] * b[i + l];
    float tail = 0.0f;
    for (; i < n; i++)
        tail += a[i] * b[i];
    for (int w = LANES / 2; w; w >>= 1)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0] + tail;
}

/* s[i] = exp(s[i] - top) for s[i] <= top (a score minus the running maximum): with x = s[i] - top,
   2^n * e^r, n = round(x / ln 2) (read from the bits of x / ln 2 + 1.5 * 2^23), r = x - n ln 2 in
   [-ln2/2, ln2/2], e^r by its degree-6 Taylor polynomial (relative error under 2e-7 over the range);
   below -87 (e^x under float's normal range) it is 0. Branch-free, so it vectorizes. */
ALWAYS_INLINE void exp_shifted(float *restrict s, float top, int count)
{
    for (int i = 0; i < count; i++) {
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
    const float *q, *kv;
    float *out;
    const int64_t *tables, *lens;
    Py_ssize_t batch, heads, kv_heads, dim, block_size, max_blocks, num_blocks;
    float scale;
} Problem;

/* n heads' state before the first tile: no output, maximum -inf, sum 0 */
ALWAYS_INLINE void start_heads(float *acc, float *m, float *l, Py_ssize_t n, Py_ssize_t dim)
{
    for (Py_ssize_t h = 0; h < n; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(n * dim) * sizeof(float));
}

/* out = acc / sum for n heads */
ALWAYS_INLINE void finish_heads(float *out, const float *acc, const float *l, Py_ssize_t n, Py_ssize_t dim)
{
    for (Py_ssize_t h = 0; h < n; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (Py_ssize_t d = 0; d < dim; d++)
            out[h * dim + d] = acc[h * dim + d] * inv;
    }
}

/* Tokens of the tile that starts at `start` of a sequence of `len`: at most `most`, never across a
   block. */
ALWAYS_INLINE int64_t tile_length(const Problem *pb, int64_t start, int64_t len, int64_t most)
{
    int64_t count = len - start;
    if (count > most)
        count = most;
    if (count > pb->block_size - start % pb->block_size)
        count = pb->block_size - start % pb->block_size;
    return count;
}

/* The online softmax's step for one query head over a tile: its `count` scaled scores s become their
   weights exp(s - top) against the new running maximum top (*m moves up to it) and join the running
   sum *l; returns the factor that rescales the output accumulated before this tile. Both paths. */
ALWAYS_INLINE float softmax_tile(float *s, int count, float *m, float *l)
{
    float top = *m;
    for (int t = 0; t < count; t++)
        top = s[t] > top ? s[t] : top;
    const float shrink = *m == -INFINITY ? 0.0f : expf(*m - top);
    *m = top;
    exp_shifted(s, top, count);
    float sum = 0.0f;
    for (int t = 0; t < count; t++)
        sum += s[t];
    *l = *l * shrink + sum;
    return shrink;
}

/* One query head over one tile of `count` tokens, any head size: scores in `s` (TILE floats). */
ALWAYS_INLINE void head_tile_any(const float *q, const float *k, const float *v, Py_ssize_t row, int64_t count,
                                 Py_ssize_t dim, float scale, float *s, float *acc, float *m, float *l)
{
    for (int64_t t = 0; t < count; t++)
        s[t] = dot(q, k + t * row, dim) * scale;
    const float shrink = softmax_tile(s, (int)count, m, l);
    for (Py_ssize_t d = 0; d < dim; d++)
        acc[d] *= shrink;
    for (int64_t t = 0; t < count; t++) {
        const float p = s[t], *vt = v + t * row;
        for (Py_ssize_t d = 0; d < dim; d++)
            acc[d] += p * vt[d];
    }
}

/* One sequence, one KV head, any head size: its `group` query heads over the sequence's blocks in
   tiles of at most TILE tokens. `work` holds group * (dim + TILE + 2) floats. */
ALWAYS_INLINE void attend(const Problem *pb, Py_ssize_t b, Py_ssize_t h, float *work)
{
    const Py_ssize_t dim = pb->dim, group = pb->heads / pb->kv_heads, row = pb->kv_heads * dim;
    const Py_ssize_t half = pb->num_blocks * pb->block_size * row; /* K -> V */
    const float *q = pb->q + (b * pb->heads + h * group) * dim;
    float *acc = work, *s = work + group * dim, *m = s + TILE, *l = m + group;
    start_heads(acc, m, l, group, dim);
    const int64_t len = pb->lens[b];
    int64_t count;
    for (int64_t start = 0; start < len; start += count) {
        count = tile_length(pb, start, len, TILE);
        const int64_t block = pb->tables[b * pb->max_blocks + start / pb->block_size];
        const float *k = pb->kv + (block * pb->block_size + start % pb->block_size) * row + h * dim;
        for (Py_ssize_t g = 0; g < group; g++)
            head_tile_any(q + g * dim, k, k + half, row, count, dim, pb->scale, s, acc + g * dim, m + g, l + g);
    }
    finish_heads(pb->out + (b * pb->heads + h * group) * dim, acc, l, group, dim);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* Head sizes that are a multiple of 16: K rows and V rows as vectors of 16 floats (GCC/clang vector
   extensions: AVX-512 registers in the x86-64-v4 clone, two or four narrower ones elsewhere). The
   16 dot products of a tile are reduced together by a transposing tree of shuffles (15 shuffle-adds
   of whole vectors instead of 16 horizontal sums), and each query head's output accumulates in
   registers over the tile. */
#define VECTOR_PATH 1
typedef float v16 __attribute__((vector_size(64)));
#define VTILE 16

ALWAYS_INLINE v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* lane i of the result = the sum of the 16 lanes of part[i] */
ALWAYS_INLINE v16 reduce16(const v16 part[VTILE])
{
    v16 a[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                       21, 22, 23)
               + __builtin_shufflevector(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                         27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                       26, 27)
               + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                         29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                                       28, 29)
               + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                                         27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Where the tile after the one of sequence b ending at `next` lies (the next sequence's first after
   a sequence's last), and its K rows' 64-byte lines in `lines`; NULL after the batch's last tile. */
ALWAYS_INLINE const char *tile_ahead(const Problem *pb, Py_ssize_t b, int64_t next, Py_ssize_t row,
                                     Py_ssize_t *lines)
{
    const Py_ssize_t seq = next < pb->lens[b] ? b : b + 1;
    const int64_t pos = seq == b ? next : 0;
    *lines = 0;
    if (seq >= pb->batch)
        return NULL;
    const int64_t count = tile_length(pb, pos, pb->lens[seq], VTILE);
    const int64_t block = pb->tables[seq * pb->max_blocks + pos / pb->block_size];
    *lines = (count * row * (Py_ssize_t)sizeof(float) + 63) / 64;
    return (const char *)(pb->kv + (block * pb->block_size + pos % pb->block_size) * row);
}

typedef int32_t vi16 __attribute__((vector_size(64)));

/* lane-wise max (a bitwise select: C has no vector ?:) */
ALWAYS_INLINE v16 vmax(const v16 *a, const v16 *b)
{
    const v16 x = *a, y = *b;
    const vi16 more = x > y;
    return (v16)(((vi16)x & more) | ((vi16)y & ~more));
}

/* the largest and the sum of the 16 lanes of x (a tree of halving shuffles) */
ALWAYS_INLINE float max16(const v16 *p)
{
    v16 x = *p;
    v16 y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = vmax(&x, &y);
    y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = vmax(&x, &y);
    y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = vmax(&x, &y);
    y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    x = vmax(&x, &y);
    return x[0];
}

ALWAYS_INLINE float sum16(const v16 *p)
{
    v16 x = *p;
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

/* softmax_tile over a whole vector of 16 scores, lanes from `count` on ignored (they become -inf,
   so weight 0): the maximum, the weights and their sum in vector registers, no scalar loop over
   the tile. */
ALWAYS_INLINE float softmax16(v16 *weights, int64_t count, float *m, float *l)
{
    v16 scores = *weights;
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi16 keep = lane < (int32_t)count;
    const v16 none = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                      -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    scores = (v16)(((vi16)scores & keep) | ((vi16)none & ~keep));
    const float most = max16(&scores), top = most > *m ? most : *m;
    const float shrink = *m == -INFINITY ? 0.0f : *m == top ? 1.0f : expf(*m - top);
    *m = top;
    float s[VTILE];
    memcpy(s, &scores, sizeof s);
    exp_shifted(s, top, VTILE);
    memcpy(&scores, s, sizeof s);
    *l = *l * shrink + sum16(&scores);
    *weights = scores;
    return shrink;
}

/* One query head over one tile of `count` tokens (K rows at k, V rows at v, `row` floats apart):
   its output so far `acc` (16 * C floats), running maximum *m and sum *l updated. The weighted sum
   of V rows runs in two interleaved accumulators (even and odd tokens) so that 2 * C independent
   chains of fused multiply-adds are in flight, not C. */
ALWAYS_INLINE void head_tile(const float *q, const float *k, const float *v, Py_ssize_t row, int64_t count,
                             float scale, float *acc, float *m, float *l, const int C)
{
    v16 qv[C], part[VTILE], even[C], odd[C];
    for (int c = 0; c < C; c++)
        qv[c] = load16(q + 16 * c);
    for (int t = 0; t < VTILE; t++) {
        v16 sum = {0};
        if (t < count)
            for (int c = 0; c < C; c++)
                sum += qv[c] * load16(k + t * row + 16 * c);
        part[t] = sum;
    }
    v16 weights = reduce16(part) * scale;
    const float shrink = softmax16(&weights, count, m, l);
    for (int c = 0; c < C; c++) {
        even[c] = load16(acc + 16 * c) * shrink;
        odd[c] = (v16){0};
    }
    /* token t's weight broadcast from the weights' register (a scalar times a 16-float vector goes
       through 16 stores to the stack where the widest register is 256 bits) */
#define SPLAT(i) __builtin_shufflevector(weights, weights, i, i, i, i, i, i, i, i, i, i, i, i, i, i, i, i)
#define V_PAIR(t0, t1)                                                                                  \
    if (count > (t1)) {                                                                                 \
        const v16 w0 = SPLAT(t0), w1 = SPLAT(t1);                                                       \
        for (int c = 0; c < C; c++) {                                                                   \
            even[c] += w0 * load16(v + (t0) * row + 16 * c);                                            \
            odd[c] += w1 * load16(v + (t1) * row + 16 * c);                                             \
        }                                                                                               \
    } else {                                                                                            \
        if (count > (t0)) {                                                                             \
            const v16 w0 = SPLAT(t0);                                                                   \
            for (int c = 0; c < C; c++)                                                                 \
                even[c] += w0 * load16(v + (t0) * row + 16 * c);                                        \
        }                                                                                               \
        goto summed;                                                                                    \
    }
    V_PAIR(0, 1) V_PAIR(2, 3) V_PAIR(4, 5) V_PAIR(6, 7) V_PAIR(8, 9) V_PAIR(10, 11) V_PAIR(12, 13)
    V_PAIR(14, 15)
#undef V_PAIR
#undef SPLAT
summed:
    for (int c = 0; c < C; c++)
        even[c] += odd[c];
    memcpy(acc, even, sizeof even);
}

/* Every query head of sequence b, for dim = 16 * C: tiles of at most 16 tokens, each tile's K and V
   rows read once for all heads (one block's rows lie together: [block_size, kv_heads, dim]), the
   next tile's rows fetched a slice per head while this one is computed (blocks are scattered: no
   hardware prefetcher guesses where the next one is, and a burst of prefetches would stall on the
   core's miss buffers). The fetch is non-temporal (prefetchnta: to the core's L1, not kept in the
   outer caches: each row is read once a step); into L2 (hint 2) measured ~15% slower, two tiles
   ahead slower still (decision 155). The heads' state (output so far, maximum, sum) stays in `work`
   between tiles. */
ALWAYS_INLINE void attend16(const Problem *pb, Py_ssize_t b, float *work, const int C)
{
    const Py_ssize_t dim = 16 * C, heads = pb->heads, group = heads / pb->kv_heads, row = pb->kv_heads * dim;
    const Py_ssize_t half = pb->num_blocks * pb->block_size * row, to_v = half * (Py_ssize_t)sizeof(float);
    float *acc = work, *m = work + heads * dim, *l = m + heads;
    start_heads(acc, m, l, heads, dim);
    const int64_t len = pb->lens[b], *table = pb->tables + b * pb->max_blocks;
    int64_t count;
    for (int64_t start = 0; start < len; start += count) {
        count = tile_length(pb, start, len, VTILE);
        Py_ssize_t lines;
        const char *ahead = tile_ahead(pb, b, start + count, row, &lines);
        const Py_ssize_t share = (lines + heads - 1) / heads;
        const float *tile =
            pb->kv + (table[start / pb->block_size] * pb->block_size + start % pb->block_size) * row;
        for (Py_ssize_t hq = 0; hq < heads; hq++) {
            for (Py_ssize_t line = hq * share; line < (hq + 1) * share && line < lines; line++) {
                __builtin_prefetch(ahead + 64 * line, 0, 0);
                __builtin_prefetch(ahead + to_v + 64 * line, 0, 0);
            }
            const float *k = tile + (hq / group) * dim;
            head_tile(pb->q + (b * heads + hq) * dim, k, k + half, row, count, pb->scale, acc + hq * dim, m + hq,
                      l + hq, C);
        }
    }
    finish_heads(pb->out + b * heads * dim, acc, l, heads, dim);
}
#else
#define VECTOR_PATH 0
#endif

/* Every sequence and KV head, without the GIL. */
KERNEL static void attend_all(const Problem *pb, float *work)
{
    for (Py_ssize_t b = 0; b < pb->batch; b++) {
#if VECTOR_PATH
        if (pb->dim == 64) {
            attend16(pb, b, work, 4);
            continue;
        }
        if (pb->dim == 128) {
            attend16(pb, b, work, 8);
            continue;
        }
#endif
        for (Py_ssize_t h = 0; h < pb->kv_heads; h++)
            attend(pb, b, h, work);
    }
}

/* whether f[0] * ... * f[n-1] == want, every factor >= 1, without overflowing */
static int product_is(Py_ssize_t want, const Py_ssize_t *f, int n)
{
    Py_ssize_t acc = 1;
    for (int i = 0; i < n; i++) {
        if (f[i] < 1 || acc > want / f[i])
            return 0;
        acc *= f[i];
    }
    return acc == want;
}

/* Every size and index checked against the buffers; 0 = fine, -1 = ValueError set. */
static int check(const Problem *pb, const Py_buffer *out, const Py_buffer *q, const Py_buffer *kv,
                 const Py_buffer *tables)
{
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), i8 = (Py_ssize_t)sizeof(int64_t);
    if (pb->kv_heads < 1 || pb->heads % pb->kv_heads != 0) {
        PyErr_Format(PyExc_ValueError, "%zd query heads over %zd KV heads", pb->heads, pb->kv_heads);
        return -1;
    }
    const Py_ssize_t q_shape[] = {pb->batch, pb->heads, pb->dim, f};
    const Py_ssize_t kv_shape[] = {2, pb->num_blocks, pb->block_size, pb->kv_heads, pb->dim, f};
    const Py_ssize_t table_shape[] = {pb->batch, pb->max_blocks, i8};
    if (!product_is(q->len, q_shape, 4) || out->len != q->len || !product_is(kv->len, kv_shape, 6)
        || !product_is(tables->len, table_shape, 3)) {
        PyErr_Format(PyExc_ValueError,
                     "buffer sizes disagree with the shape: q %zd B, out %zd B, kv %zd B, block tables %zd B "
                     "for %zd sequences of %zd heads of %zd, %zd blocks of %zd tokens, %zd KV heads",
                     q->len, out->len, kv->len, tables->len, pb->batch, pb->heads, pb->dim, pb->num_blocks,
                     pb->block_size, pb->kv_heads);
        return -1;
    }
    for (Py_ssize_t b = 0; b < pb->batch; b++) {
        const int64_t len = pb->lens[b];
        if (len < 1 || len > (int64_t)pb->max_blocks * pb->block_size) {
            PyErr_Format(PyExc_ValueError, "sequence %zd: length %lld outside 1..%zd", b, (long long)len,
                         pb->max_blocks * pb->block_size);
            return -1;
        }
        for (int64_t j = 0; j < (len + pb->block_size - 1) / pb->block_size; j++) {
            const int64_t block = pb->tables[b * pb->max_blocks + j];
            if (block < 0 || block >= pb->num_blocks) {
                PyErr_Format(PyExc_ValueError, "sequence %zd: block %lld outside the cache's %zd", b,
                             (long long)block, pb->num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *args)
{
    Py_buffer out, q, kv, tables, lens;
    Problem pb = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*nnnnnf:decode", &out, &q, &kv, &tables, &lens, &pb.num_blocks,
                          &pb.block_size, &pb.kv_heads, &pb.heads, &pb.dim, &pb.scale))
        return NULL;
    PyObject *result = NULL;
    float *work = NULL;
    pb.q = q.buf;
    pb.kv = kv.buf;
    pb.out = out.buf;
    pb.tables = tables.buf;
    pb.lens = lens.buf;
    pb.batch = lens.len / (Py_ssize_t)sizeof(int64_t);
    if (pb.batch < 1 || lens.len % (Py_ssize_t)sizeof(int64_t) != 0 || pb.block_size < 1) {
        PyErr_Format(PyExc_ValueError, "lens hold %zd B: not one int64 or more; block size %zd", lens.len,
                     pb.block_size);
        goto done;
    }
    pb.max_blocks = tables.len / (pb.batch * (Py_ssize_t)sizeof(int64_t));
    if (check(&pb, &out, &q, &kv, &tables) < 0)
        goto done;
    work = malloc((size_t)(pb.heads * (pb.dim + TILE + 2)) * sizeof(float)); /* >= attend's and attend16's */
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    attend_all(&pb, work);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(work);
    PyBuffer_Release(&out);
    PyBuffer_Release(&q);
    PyBuffer_Release(&kv);
    PyBuffer_Release(&tables);
    PyBuffer_Release(&lens);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(out, q, kv, block_tables, seq_lens, num_blocks, block_size, num_kv_heads, num_heads, head_dim, "
     "scale): one query per "
     "sequence attends over its blocks of one layer's paged KV cache, read in place (float32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_paged_attention", "Decode attention over the paged KV cache, read in place.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__paged_attention(void)
{
    return PyModule_Create(&module);
}
