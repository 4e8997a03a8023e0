/* kvwire.transfer.planes.shm._copy_runs: byte runs copied in one call, without the GIL.

   copy_runs(src, dst, runs, stream=False) copies dst[d:d+n] = src[s:s+n] for each (s, d, n) of
   ``runs``, a buffer of int64 triples. Every run is checked against the two buffers first
   (ValueError, nothing copied); the copies then run with the GIL released, so the caller's other
   threads (an engine's forward, the plane's control thread) go on meanwhile and copies on several
   threads overlap. ``stream``: write with non-temporal stores (x86-64; memcpy elsewhere), for bytes
   this process will not read again and too many to stay in its caches: no read of the destination
   before it is written, no eviction of the caller's working set (fenced before returning).

   Why native: the shared-memory plane copies a request's KV blocks run by run (one 32 KiB run per
   block half of Llama-3-8B). From Python each run costs a slice assignment and the whole loop holds
   the GIL; here a run costs one memcpy (docs/decisions/112-native-run-copies.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

/* n bytes from s to d, the 16-byte-aligned middle with non-temporal stores */
static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
}
#define STREAMING 1
#else
#define stream_copy(d, s, n) memcpy((d), (s), (n))
#define STREAMING 0
#endif

static int64_t run_field(const char *runs, Py_ssize_t i, int field)
{
    int64_t v;
    memcpy(&v, runs + (i * 3 + field) * (Py_ssize_t)sizeof(int64_t), sizeof v);
    return v;
}

static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    Py_buffer src, dst, runs;
    int stream = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*|p:copy_runs", &src, &dst, &runs, &stream))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t triple = 3 * (Py_ssize_t)sizeof(int64_t);
    if (runs.len % triple != 0) {
        PyErr_Format(PyExc_ValueError, "runs hold %zd bytes, not a whole number of int64 triples", runs.len);
        goto done;
    }
    const Py_ssize_t count = runs.len / triple;
    const char *r = (const char *)runs.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t s = run_field(r, i, 0), d = run_field(r, i, 1), n = run_field(r, i, 2);
        if (s < 0 || d < 0 || n < 0 || s > src.len - n || d > dst.len - n) {
            PyErr_Format(PyExc_ValueError,
                         "run %zd (%lld, %lld, %lld) outside the source (%zd B) or destination (%zd B)",
                         i, (long long)s, (long long)d, (long long)n, src.len, dst.len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (stream) {
        for (Py_ssize_t i = 0; i < count; i++)
            stream_copy((char *)dst.buf + run_field(r, i, 1), (const char *)src.buf + run_field(r, i, 0),
                        (size_t)run_field(r, i, 2));
#if STREAMING
        _mm_sfence(); /* the stores are visible before the caller announces them */
#endif
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            memcpy((char *)dst.buf + run_field(r, i, 1), (const char *)src.buf + run_field(r, i, 0),
                   (size_t)run_field(r, i, 2));
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&runs);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(src, dst, runs, stream=False): dst[d:d+n] = src[s:s+n] for each int64 triple "
     "(s, d, n) of runs; bounds checked first, copies without the GIL; stream: non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_runs", "Byte runs copied in one call, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__copy_runs(void)
{
    return PyModule_Create(&module);
}
