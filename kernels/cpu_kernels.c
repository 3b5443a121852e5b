/* localpd's CPU kernels, called through ctypes (kernels/cpu.py builds this file with the machine's C compiler at
 * first use, -O3 -march=native, and caches the library).
 *
 * - lpd_linear: y = x @ W.T (+ bias) for an int4 (group-wise scale + bias) or int8 (group-wise scale) weight as
 *   quant/weights.py stores it, with the input step fused in front (residual add + RMSNorm, or act(gate) * up).
 *   The input rows are rounded to int8 in blocks of 32 (one float scale a block, as llama.cpp's Q8 blocks), and
 *   each block's products are summed in int32 (AVX512-VNNI vpdpbusd, AVX2 vpmaddwd, or plain C), then scaled.
 * - lpd_attention: paged attention over fp32, float16, int8 or int4 keys and values, each side its own format
 *   (decode rows and causal prefill chunks, GQA, sliding windows), softmax in float.
 * - lpd_rope_write: RoPE on the query and key heads of a qkv row, in place, and the key and value heads written
 *   into their KV slots (fp32, float16, int8 with a scale a head, int4 with a scale and zero a group of 32).
 * Each has a torch reference with the same arguments (kernels/dispatch.py, localpd/kvcache/dispatch.py), which the tests
 * compare it with. Work is shared by a small pool of threads that spin between calls, then sleep. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LPD_ISA "avx512-vnni"
#define LPD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LPD_ISA "avx2"
#define LPD_AVX2 1
#else
#define LPD_ISA "c"
#endif

const char *lpd_isa(void) { return LPD_ISA; }

/* Asks the kernel to back [p, p + n) with transparent huge pages before it is first written (Linux, where THP is
 * "madvise"): a decode step streams every weight once, and on 4 KiB pages each page is a TLB miss that stops the
 * hardware prefetcher at its boundary. Returns 0, or -1 where the kernel or the system does not take the advice. */
int lpd_huge_pages(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    return madvise(p, n, MADV_HUGEPAGE);
#else
    (void)p, (void)n;
    return -1;
#endif
}

/* ------------------------------------------------------------------------------------------------------------
 * Threads. Built with OpenMP (linked to torch's own runtime, kernels/cpu.py), a call's shares run on the same team
 * of threads as torch's operators, so that neither spins on a core the other needs. Without it, a small pool of
 * our own: workers 1..n-1 wait for a new generation, run their share, count down; the caller runs share 0. */
typedef void (*task_fn)(void *ctx, int ith, int nth);

#if defined(_OPENMP)
#include <omp.h>
const char *lpd_threads(void) { return "openmp"; }

static void parallel(task_fn fn, void *ctx, int nth) {
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return;
    }
#pragma omp parallel num_threads(nth)
    fn(ctx, omp_get_thread_num(), omp_get_num_threads());
}
#else
const char *lpd_threads(void) { return "pthreads"; }

#define MAX_THREADS 64
#define SPINS 50000 /* ~2000 pauses, then ~50 ms of yields, then sleep */

static pthread_t workers[MAX_THREADS];
static int n_workers;
static atomic_uint generation;
static atomic_int pending, sleeping;
static task_fn task;
static void *task_ctx;
static int task_nth;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;

static unsigned start_generation[MAX_THREADS]; /* the generation a worker was started at: it runs the next one */

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seen = start_generation[id];
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < SPINS) { /* pause a while, then yield the core to whatever else wants it (torch's threads) */
                if (spins < 2000) cpu_relax();
                else sched_yield();
                continue;
            }
            pthread_mutex_lock(&pool_mu);
            atomic_fetch_add(&sleeping, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
            atomic_fetch_sub(&sleeping, 1);
            pthread_mutex_unlock(&pool_mu);
            spins = 0;
        }
        seen = g;
        if (id < task_nth) task(task_ctx, id, task_nth);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one caller at a time (ctypes drops the GIL) */

static void parallel(task_fn fn, void *ctx, int nth) {
    if (nth > MAX_THREADS) nth = MAX_THREADS;
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&call_mu);
    while (n_workers < nth - 1) {
        start_generation[n_workers + 1] = atomic_load(&generation);
        if (pthread_create(&workers[n_workers], NULL, worker_main, (void *)(intptr_t)(n_workers + 1)) != 0) break;
        n_workers++;
    }
    if (n_workers < nth - 1) nth = n_workers + 1;
    task = fn;
    task_ctx = ctx;
    task_nth = nth;
    atomic_store(&pending, n_workers);
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleeping)) {
        pthread_mutex_lock(&pool_mu);
        pthread_cond_broadcast(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
    }
    fn(ctx, 0, nth);
    for (int spins = 0; atomic_load_explicit(&pending, memory_order_acquire); spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield(); /* a worker that is not running (more threads than free cores) needs this core */
    }
    pthread_mutex_unlock(&call_mu);
}
#endif

static void share(int n, int ith, int nth, int *lo, int *hi) { /* [lo, hi) of n items for thread ith */
    *lo = (int)((long)n * ith / nth);
    *hi = (int)((long)n * (ith + 1) / nth);
}

/* Scratch that lives as long as the calling thread: grown, never shrunk. */
static void *scratch(void **buf, size_t *cap, size_t need) {
    if (need > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (need + 63) / 64 * 64);
        *cap = *buf ? need : 0;
    }
    return *buf;
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Whether the library stores and reads float16 KV pages: with the processor's conversions (F16C) or the compiler's
 * _Float16 (round to nearest even, as torch's .half()). */
#if defined(__F16C__) || defined(__FLT16_MAX__)
#define LPD_HALF_PAGES 1
#endif
int lpd_half_pages(void) {
#if defined(LPD_HALF_PAGES)
    return 1;
#else
    return 0;
#endif
}

#if defined(LPD_HALF_PAGES)
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
#endif
}
#endif

/* KV page formats (kvcache/formats.py), each side (keys, values) its own: float, float16, int8 codes with one
 * float16 scale a token and head (amax / 127), int4 codes in groups of 32 with a float16 scale and zero each
 * ((max - min) / 15 and min; two codes a byte, the even element in the low nibble), and int4ch: int4 codes with a
 * float16 scale and zero a page, head and channel, over the page's tokens (KIVI), the open page's values as
 * computed kept in a stage (a page of rows a running sequence) from which each write rounds the page again. A
 * side's rows are its pages' [n_pages * PS * H] heads, in row order; its scales and zeros [rows, groups] beside
 * them, int4ch's [n_pages * H, D]. */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2, KV_I4 = 3, KV_I4CH = 4 };
typedef struct {
    void *data;
    uint16_t *scale, *zero; /* int8's scales, int4's and int4ch's scales and zeros (else unused) */
    int fmt;
    int ps, heads;  /* int4ch: tokens a page, heads a token (its scales' rows are a page's heads) */
    float *stage;   /* int4ch: the stage, [n_stage, heads, D] float rows (slot r * ps + offset: row r's page) */
    long n_stage;
} kv_side;
static inline size_t kv_row_bytes(int fmt, int D) {
    return fmt == KV_F32 ? 4 * (size_t)D : fmt == KV_F16 ? 2 * (size_t)D : fmt == KV_I8 ? (size_t)D : (size_t)D / 2;
}
static inline const char *kv_row(const kv_side *s, long row, int D) {
    return (const char *)s->data + row * kv_row_bytes(s->fmt, D);
}

/* n floats to float16 (fmt KV_F16) or copied as they are (KV_F32). */
static void store_row(void *dst, const float *src, int n, int fmt) {
    if (fmt == KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
#if defined(LPD_HALF_PAGES)
    uint16_t *d = dst;
    int i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) d[i] = float_to_half(src[i]);
#endif
}

/* One head's D floats into row `row` of a side, rounded as formats.quantize_kv rounds (int8 and int4: the same
 * codes, scales and zeros, round half to even as torch.round), so its divisions stay divisions: this file's
 * -freciprocal-math would multiply by a rounded reciprocal instead. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-reciprocal-math")))
#endif
static void store_head(kv_side *s, long row, const float *x, int D) {
#if defined(__clang__)
#pragma float_control(precise, on)
#endif
    char *dst = (char *)kv_row(s, row, D);
    if (s->fmt == KV_F32 || s->fmt == KV_F16) {
        store_row(dst, x, D, s->fmt);
        return;
    }
#if defined(LPD_HALF_PAGES)
    if (s->fmt == KV_I8) {
        float amax = 0.f;
        for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        uint16_t sh = float_to_half(amax / 127.0f);
        float sc = half_to_float(sh), safe = sc > 0.f ? sc : 1.f;
        for (int d = 0; d < D; d++) {
            float y = nearbyintf(x[d] / safe);
            ((int8_t *)dst)[d] = (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y);
        }
        s->scale[row] = sh;
        return;
    }
    for (int g = 0; g < D / 32; g++) { /* KV_I4 */
        const float *xg = x + 32 * g;
        float lo = xg[0], hi = xg[0];
        for (int j = 1; j < 32; j++) lo = xg[j] < lo ? xg[j] : lo, hi = xg[j] > hi ? xg[j] : hi;
        uint16_t sh = float_to_half((hi - lo) / 15.0f), zh = float_to_half(lo);
        float sc = half_to_float(sh), z = half_to_float(zh), safe = sc > 0.f ? sc : 1.f;
        uint8_t *b = (uint8_t *)dst + 16 * g;
        for (int j = 0; j < 32; j += 2) {
            float e = nearbyintf((xg[j] - z) / safe), o = nearbyintf((xg[j + 1] - z) / safe);
            int qe = e < 0.f ? 0 : e > 15.f ? 15 : (int)e, qo = o < 0.f ? 0 : o > 15.f ? 15 : (int)o;
            b[j / 2] = (uint8_t)(qe | qo << 4);
        }
        s->scale[row * (D / 32) + g] = sh, s->zero[row * (D / 32) + g] = zh;
    }
#endif
}

/* D int4 codes (two a byte, the even element low) in floats: code times its group's scale, plus its zero, a
 * product and then a sum as formats.dequantize_kv computes them, not one fused multiply-add (this function alone
 * compiled without contraction: an attribute on load_row would keep it from being inlined). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void load_int4_row(float *dst, const uint8_t *b, const uint16_t *scale, const uint16_t *zero, int D) {
    for (int g = 0; g < D / 32; g++) {
        float sc = half_to_float(scale[g]), z = half_to_float(zero[g]);
#if defined(LPD_AVX2) || defined(LPD_AVX512)
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 16 * g)), m = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
        __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi); /* elements 0-15, 16-31 */
        __m128i part[4] = {e0, _mm_srli_si128(e0, 8), e1, _mm_srli_si128(e1, 8)};
        __m256 vs = _mm256_set1_ps(sc), vz = _mm256_set1_ps(z);
        for (int k = 0; k < 4; k++) {
            __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k])), vs);
            _mm256_storeu_ps(dst + 32 * g + 8 * k, _mm256_add_ps(p, vz));
        }
#else
        for (int j = 0; j < 16; j++) {
            float e = (float)(b[16 * g + j] & 15) * sc, o = (float)(b[16 * g + j] >> 4) * sc;
            dst[32 * g + 2 * j] = e + z, dst[32 * g + 2 * j + 1] = o + z;
        }
#endif
    }
}

/* D int4ch codes in floats: code times its channel's scale, plus its zero (a product, then a sum, as
 * formats.dequantize_kv computes them). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void load_int4ch_row(float *dst, const uint8_t *b, const uint16_t *scale, const uint16_t *zero, int D) {
    int d = 0;
#if (defined(LPD_AVX2) || defined(LPD_AVX512)) && defined(__F16C__)
    __m128i m = _mm_set1_epi8(15);
    for (; d + 16 <= D; d += 16) {
        __m128i v = _mm_loadl_epi64((const __m128i *)(b + d / 2));
        __m128i e = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m)); /* 16 codes */
        for (int k = 0; k < 2; k++) {
            __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k ? _mm_srli_si128(e, 8) : e));
            __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + d + 8 * k)));
            __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zero + d + 8 * k)));
            _mm256_storeu_ps(dst + d + 8 * k, _mm256_add_ps(_mm256_mul_ps(c, sc), z));
        }
    }
#endif
    for (; d < D; d++) {
        float c = (float)((b[d / 2] >> (4 * (d & 1))) & 15) * half_to_float(scale[d]);
        dst[d] = c + half_to_float(zero[d]);
    }
}

/* int4ch's rounding of one head of a page's first n tokens (dispatch._round_pages): each channel's scale (max -
 * min) / 15 and zero min over them, in float16, and each value's code round((x - zero) / scale) (half to even,
 * a division as torch divides: see store_head) in 0 .. 15. The tokens' values are rows 0 .. n - 2 of `stage`
 * (row stride `stride` floats), then `last`; codes go to n rows of D / 2 bytes, `cstride` bytes apart. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-reciprocal-math")))
#endif
static void round_channels(const float *stage, long stride, const float *last, int n, int D, uint8_t *codes,
                           long cstride, uint16_t *scale, uint16_t *zero) {
#if defined(__clang__)
#pragma float_control(precise, on)
#endif
    float lo[256], hi[256], z[256], safe[256]; /* head_dim <= 256 (kvcache.dispatch.kernel_head_dim) */
    for (int d = 0; d < D; d++) lo[d] = hi[d] = last[d];
    for (int o = 0; o < n - 1; o++) {
        const float *x = stage + o * stride;
        for (int d = 0; d < D; d++) lo[d] = x[d] < lo[d] ? x[d] : lo[d], hi[d] = x[d] > hi[d] ? x[d] : hi[d];
    }
    for (int d = 0; d < D; d++) {
        uint16_t sh = float_to_half((hi[d] - lo[d]) / 15.0f), zh = float_to_half(lo[d]);
        float sc = half_to_float(sh);
        z[d] = half_to_float(zh), safe[d] = sc > 0.f ? sc : 1.f;
        scale[d] = sh, zero[d] = zh;
    }
    for (int o = 0; o < n; o++) {
        const float *x = o == n - 1 ? last : stage + o * stride;
        uint8_t *c = codes + o * cstride;
        for (int d = 0; d < D; d += 2) {
            float e = nearbyintf((x[d] - z[d]) / safe[d]), f = nearbyintf((x[d + 1] - z[d + 1]) / safe[d + 1]);
            int qe = e < 0.f ? 0 : e > 15.f ? 15 : (int)e, qf = f < 0.f ? 0 : f > 15.f ? 15 : (int)f;
            c[d / 2] = (uint8_t)(qe | qf << 4);
        }
    }
}

/* One head (h) of a token at `slot` of an int4ch side, staged at `sslot` (its page's offset 0 at sslot - offset):
 * staged unless it fills its page (a full page is final), then, where it is the last of the step's tokens in its
 * page (`last`), the page's tokens up to it rounded again (dispatch._write_pages_ref: a sequence fills its page in
 * order, so its earlier tokens are all staged; rounding at each of a chunk's tokens would end the same). */
static void store_page_head(kv_side *s, long slot, long sslot, int h, const float *x, int D, int last) {
    int PS = s->ps, H = s->heads, off = (int)(slot % PS);
    long page = slot / PS, first = sslot - off;
    if (off < PS - 1) memcpy(s->stage + (sslot * H + h) * D, x, sizeof(float) * D);
    if (!last) return;
    round_channels(s->stage + (first * H + h) * D, (long)H * D, x, off + 1, D,
                   (uint8_t *)s->data + ((page * PS) * H + h) * (D / 2), (long)H * (D / 2),
                   s->scale + (page * H + h) * D, s->zero + (page * H + h) * D);
}

/* Row `row` of a side (one head of one token) in D floats: as stored, from float16, codes times their scale
 * (int8), or load_int4_row's. */
static inline void load_row(float *dst, const kv_side *s, long row, int D) {
    const char *src = kv_row(s, row, D);
    int i = 0;
    if (s->fmt == KV_F32) {
        memcpy(dst, src, sizeof(float) * D);
    } else if (s->fmt == KV_F16) {
        const uint16_t *h = (const uint16_t *)src;
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < D; i++) dst[i] = half_to_float(h[i]);
    } else if (s->fmt == KV_I8) {
        const int8_t *c = (const int8_t *)src;
        float sc = half_to_float(s->scale[row]);
#if defined(LPD_AVX2) || defined(LPD_AVX512)
        __m256 vs = _mm256_set1_ps(sc);
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                        _mm_loadl_epi64((const __m128i *)(c + i)))), vs));
#endif
        for (; i < D; i++) dst[i] = (float)c[i] * sc;
    } else if (s->fmt == KV_I4) {
        load_int4_row(dst, (const uint8_t *)src, s->scale + row * (D / 32), s->zero + row * (D / 32), D);
    } else { /* KV_I4CH: the page's (row / (ps heads)) scales and zeros of the row's head (row % heads) */
        long ch = row / ((long)s->ps * s->heads) * s->heads + row % s->heads;
        load_int4ch_row(dst, (const uint8_t *)src, s->scale + ch * D, s->zero + ch * D, D);
    }
}

/* ------------------------------------------------------------------------------------------------------------
 * The input step and the activations' int8 blocks. */
#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* The sum of a register's eight floats. */
static inline float hsum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
#endif

#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* e^x of eight floats: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by Cephes' expf polynomial (within 2 ulp of libm's
 * expf), times 2^n through the exponent bits; x clamped to where e^x is a normal float. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.37f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
enum { PRE_NONE = 0, PRE_NORM = 1, PRE_SILU = 2, PRE_GELU_TANH = 3 };

static inline float silu(float g) { return g / (1.0f + expf(-g)); }
static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* 1 / RMS of the row x + residual (residual NULL: x alone), K floats: RMSNorm's factor. */
static float norm_factor(const float *x, const float *residual, int K, float eps) {
    float ss = 0.f;
    for (int k = 0; k < K; k++) {
        float s = residual ? x[k] + residual[k] : x[k];
        ss += s * s;
    }
    return 1.0f / sqrtf(ss / K + eps);
}

/* Columns k0 .. k1 - 1 of the matmul's input in float, h[k], from input row x (K floats, or 2K for a gate): x as it
 * is; RMSNorm(x + residual) * norm_w (r: the row's norm_factor), storing x + residual in sum_out (which must not
 * be x or residual: other threads read their whole rows meanwhile); or act(gate) * up. */
static void input_cols(int pre, const float *x, const float *residual, const float *norm_w, float r, float *sum_out,
                       int K, int k0, int k1, float *h) {
    if (pre == PRE_NORM) {
        for (int k = k0; k < k1; k++) {
            float s = residual ? x[k] + residual[k] : x[k];
            sum_out[k] = s;
            h[k] = s * r * norm_w[k];
        }
    } else if (pre == PRE_SILU) {
        int k = k0;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
        for (; k + 8 <= k1; k += 8) { /* g / (1 + e^-g) * up */
            __m256 g = _mm256_loadu_ps(x + k), one = _mm256_set1_ps(1.f);
            __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(h + k, _mm256_mul_ps(act, _mm256_loadu_ps(x + K + k)));
        }
#endif
        for (; k < k1; k++) h[k] = silu(x[k]) * x[K + k];
    } else if (pre == PRE_GELU_TANH) {
        for (int k = k0; k < k1; k++) h[k] = gelu_tanh(x[k]) * x[K + k];
    } else {
        memcpy(h + k0, x + k0, sizeof(float) * (k1 - k0));
    }
}

/* Blocks b0 .. b1 - 1 of h (32 values each) to two int8 levels, v ~ (256 hi + lo) d with d = amax / 127 / 256: hi
 * rounds v at scale 256 d, lo rounds what is left at scale d (|lo| <= 128, clamped to 127), so each block carries
 * ~15 bits where one int8 level alone cost +0.5% perplexity on the default model's decode. isum = sum of (256 hi +
 * lo). `deint` stores each block's even columns first, then its odd ones (the order of an int4 block's low and
 * high nibbles). hi, lo, d, isum: the row's, indexed as h is. */
#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* Four registers of eight int32 (a block's 32 values in order, each within int8) as 32 int8 in that order, or
 * with deint, the even columns first, then the odd ones. */
static inline __m256i pack_block(__m256i v0, __m256i v1, __m256i v2, __m256i v3, int deint) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3)); /* lanes interleaved */
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));            /* columns 0 .. 31 */
    if (!deint) return b;
    __m256i even_first = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, even_first), _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

static void quantize_blocks(const float *h, int b0, int b1, int deint, int8_t *hi, int8_t *lo, float *d,
                            int32_t *isum) {
    for (int b = b0; b < b1; b++) {
        const float *v = h + b * 32;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
        __m256 x[4], sign = _mm256_set1_ps(-0.f);
        for (int i = 0; i < 4; i++) x[i] = _mm256_loadu_ps(v + 8 * i);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256 vstep = _mm256_set1_ps(step), vinv = _mm256_set1_ps(inv), vinv256 = _mm256_set1_ps(inv * 256.f);
        __m256i c[4], r[4], lim = _mm256_set1_epi32(127), sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) { /* hi = round(v / step); lo = round((v - hi step) / step * 256), clamped */
            c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], vinv));
            __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c[i]), vstep, x[i]);
            r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, vinv256));
            r[i] = _mm256_max_epi32(_mm256_min_epi32(r[i], lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_slli_epi32(c[i], 8), r[i]));
        }
        _mm256_storeu_si256((__m256i *)(hi + b * 32), pack_block(c[0], c[1], c[2], c[3], deint));
        _mm256_storeu_si256((__m256i *)(lo + b * 32), pack_block(r[0], r[1], r[2], r[3], deint));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        d[b] = step / 256.f;
        isum[b] = _mm_cvtsi128_si32(s4);
#else
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int j = 0; j < 32; j++) {
            int c = (int)lrintf(v[j] * inv);
            int r = (int)lrintf((v[j] - (float)c * step) * (inv * 256.f));
            r = r > 127 ? 127 : r < -127 ? -127 : r;
            int at = deint ? (j & 1) * 16 + (j >> 1) : j;
            hi[b * 32 + at] = (int8_t)c;
            lo[b * 32 + at] = (int8_t)r;
            s += 256 * c + r;
        }
        d[b] = step / 256.f;
        isum[b] = s;
#endif
    }
}

/* ------------------------------------------------------------------------------------------------------------
 * The products. Weight row n: int4 `w4` K/2 bytes (byte i: column 2i low nibble, 2i+1 high), or int8 `w8` K bytes;
 * scales (and int4 biases) float16, one per group of columns. ds[b] = the weight's scale times the activation
 * block's scale: the factor of block b's integer sum. */
typedef struct {
    int M, N, K, group, bits;
    const int8_t *xq; /* the high levels; the low ones at xq + lo */
    size_t lo;
    const float *xd;
    const int32_t *xsum;
    const float *xsf;   /* xd x xsum, each block's sum in float (gemm_task fills it): what an int4 bias multiplies */
    const int16_t *x16; /* AVX2: each input value as one int16, 256 hi + lo (gemm_task fills it) */
    const uint8_t *w;
    const uint16_t *scales, *biases; /* int4-k (sub set): each super-block's d and dmin */
    const uint8_t *sub;               /* int4-k: each group's scale byte, then its minimum (int8); else NULL */
    const int8_t *lut; /* a codebook weight's 16 values (codebook_code); else NULL */
    const float *bias;
    float *y;
    float *side;     /* AVX512: the thread's weight_side scratch (gemm_task) */
    const float *xt; /* AVX512, several rows: xd, xsf and the sums in float by block, then row (mp a block) */
    int mp;          /* the rows rounded up to 16 */
    const int16_t *xw; /* AVX512, several rows: each value as the int16 256 hi + lo, as gemm_tile takes them
                        * (widen_row; gemm_task fills it) */
    const uint8_t *high; /* a 5-bit weight (bits 4, its low four bits int4's): each code's fifth bit; else NULL */
    const uint8_t *top;  /* a 6-bit weight (Q6_K): its codes' two upper bits (upper_group); else NULL */
    const int32_t *xs16; /* Q6_K: each input sub-block's integer sum (gemm_task fills it) */
    const int8_t *sc16;  /* Q6_K, Q3_K, Q2_K: an int8 scale a sub-block of 16 columns (two a block), `scales` its
                          * float16 d a super-block of 256: value = d x sc x (q - sub16_offset) (- dmin x mn); else
                          * NULL */
    const int8_t *mn16;  /* Q2_K: an int8 minimum a sub-block of 16, `biases` its float16 dmin a super-block (Q6_K and
                          * Q3_K: NULL, no biases) */
} gemm_args;

/* A 5-bit weight (quant/int5.py: GGUF's Q5_0, Q5_1, Q5_K) is an int4 weight, its scales, biases and int4-k
 * factors as they are, whose codes have a fifth bit: codes 0 .. 31. Row n's fifth bits are K / 8 bytes (`high`:
 * quant/int5.py's `fifth`), in the order the products expand a block's nibbles: position e is column 2e for e < 16
 * (a low nibble), column 2 (e - 16) + 1 past it (a high one). Each eight blocks of a row (b = 8g .. 8g + 7) take 32
 * bytes, byte e holding at bit j block 8g + j's bit for position e (FIFTH_GROUP: AVX2 widens a group's 16 bytes of
 * each half once and gives each block its bits by a shift and a mask); the blocks past a row's last eight take 4
 * bytes each, a little-endian uint32 whose bit e is position e's. A code row's bytes (K / 2) are 4x its bit row's:
 * a row's bits are found from its codes' address. */
#define FIFTH_GROUP 8
static inline size_t plane_row(const gemm_args *a, const uint8_t *wrow) { /* wrow's bits' offset in a plane */
    return (size_t)(wrow - (const uint8_t *)a->w) >> 2;
}
static inline int fifth_grouped(int K) { return K / 256 * FIFTH_GROUP; } /* the blocks of a row held in groups */
/* The 32 bytes of block b's group (b < fifth_grouped(K)); row: the row's K / 8 bytes. */
static inline const uint8_t *fifth_group(const uint8_t *row, int b) { return row + 32 * (size_t)(b / FIFTH_GROUP); }
/* Block b's 32 fifth bits as one word, bit e position e's; row: the row's K / 8 bytes. */
static inline uint32_t fifth_word(const uint8_t *row, int K, int b) {
    uint32_t v = 0;
    if (b >= fifth_grouped(K)) {
        memcpy(&v, row + 4 * (size_t)b, 4);
        return v;
    }
    const uint8_t *g = fifth_group(row, b);
    int j = b % FIFTH_GROUP;
#if defined(LPD_AVX512) || defined(LPD_AVX2) /* bit j of each byte to its top bit (16-bit shifts: what crosses from
                                              * the byte below stays under bit 7), then the 32 top bits */
    __m256i bytes = _mm256_loadu_si256((const __m256i *)g);
    v = (uint32_t)_mm256_movemask_epi8(_mm256_sll_epi16(bytes, _mm_cvtsi32_si128(7 - j)));
#else
    for (int e = 0; e < 32; e++) v |= (uint32_t)(g[e] >> j & 1) << e;
#endif
    return v;
}
static inline uint32_t fifth32(const gemm_args *a, const uint8_t *wrow, int b) {
    return fifth_word(a->high + plane_row(a, wrow), a->K, b);
}
/* Q6_K's codes are 6 bits: their low four int4's nibbles, their two upper bits in `top` (quant/int6k.py's `upper`):
 * each four blocks of a row (b = 4g .. 4g + 3) take 32 bytes, byte e holding at bits 2j, 2j + 1 block 4g + j's
 * bits for byte e of the block as the products expand its nibbles (fifth_word's order), so that one load and a shift
 * give a block's 32 pairs in place. A code row's bytes (K / 2) are twice its upper row's. upper_group: the 32 bytes
 * of block b's group. */
static inline const uint8_t *upper_group(const uint8_t *top, size_t row_at, int b) {
    return top + row_at + 32 * (size_t)(b >> 2);
}
static inline const uint8_t *upper_of(const gemm_args *a, const uint8_t *wrow, int b) {
    return upper_group(a->top, (size_t)(wrow - (const uint8_t *)a->w) >> 1, b);
}
/* Block j's (b & 3's) two bits of group byte u, as the code's bits 4 and 5. */
static inline int upper_code(uint8_t u, int j) { return ((u >> (2 * j)) & 3) << 4; }
/* Q6_K (sc16 set): factors a row, two a block (a scale a sub-block of 16 columns). In a block's expanded bytes
 * (low nibbles: its even columns, then high: its odd ones) the columns 0 .. 15 of sub-block 0 are bytes 0 .. 7 and
 * 16 .. 23, so int32 lanes 0, 1, 4, 5 of the block's eight (and AVX2's madd lanes 0 .. 3 of both halves). */
static inline int factor_count(const gemm_args *a) { return a->sc16 ? a->K / 16 : a->K / 32; }
/* A code with a scale a sub-block of 16 is signed, stored offset by half its range: Q6_K's six bits (with upper
 * bits) by 32, Q3_K's held in nibbles (no planes: quant/int6k.py's Int3KWeight) by 8; Q2_K's (mn16 set) are
 * unsigned, a minimum a sub-block taking the place of the offset. */
static inline int sub16_offset(const uint8_t *high, const uint8_t *top, const int8_t *mn16) {
    return mn16 ? 0 : top ? 32 : high ? 16 : 8;
}

/* A codebook weight (quant/codebook.py: IQ4_NL, IQ4_XS, MXFP4) holds 4-bit codes whose values are a 16-entry int8
 * table's, times a float16 scale a block of 32 (bits 4, lut set). The products look each code up in registers
 * (vpermb or vpshufb) and then take it as an int8 weight: signed values, no bias, AVX512's flipped by 128. A row's
 * blocks go in pairs of 32 bytes, byte j holding column j of the pair's first block in its low nibble and column j
 * of its second in its high one; an odd last block takes 16 bytes, byte j holding its columns j and j + 16. So one
 * 32-byte load, shifted by 0 and 4 bits, gives a pair's 64 codes in the order of its 64 int8 bytes: the input is not
 * deinterleaved, and each block's integer sums, and the lanes that hold them, are those of the same values held as
 * int8: the same floats, at half the bytes. */
static inline int signed_codes(const gemm_args *a) { return a->bits == 8 || a->lut; }
static inline int deinterleaved(int bits, const int8_t *lut) { return bits == 4 && !lut; }
/* A symmetric int4 or 5-bit weight (a Q4_0 or Q5_0 file's) comes without biases (NULL; kernels/cpu.py's weight_plan
 * leaves them out where each is exactly this): each group's bias is its scale times this, exactly (a power of two),
 * so that its floats are those of the same weight with its biases, at a tenth fewer bytes a decode step. */
static inline float symmetric_bias(const uint8_t *high) { return high ? -16.f : -8.f; }
/* A weight's format as plain flags: passed as constants to an always_inline loop (AVX2's gemv4, one copy a format),
 * every test of them in it folds away at compile time, where testing a->lut, a->bits, a->high, a->top and a->sc16
 * in each block of each row laid the int4 path out of line and cost the default model's decode half its speed
 * (docs/PERF.md); elsewhere fmt_of(a) passes a's own. */
typedef struct { int lut, b4, high, top, sc16; } wfmt;
static inline wfmt fmt_of(const gemm_args *a) {
    return (wfmt){a->lut != 0, a->bits == 4, a->high != 0, a->top != 0, a->sc16 != 0};
}
/* The weight formats the loader makes, as wfmt's flags (lut, b4, high, top, sc16): a loop that takes its format as
 * constants is compiled once for each (LPD_DISPATCH), a weight of any other on its own flags. */
#define LPD_FORMATS(X)                                                                                             \
    X(0, 1, 0, 0, 0) /* int4 */                                                                                    \
    X(0, 0, 0, 0, 0) /* int8 */                                                                                    \
    X(1, 1, 0, 0, 0) /* codebooks */                                                                               \
    X(0, 1, 1, 0, 0) /* 5-bit */                                                                                   \
    X(0, 1, 0, 1, 1) /* Q6_K */                                                                                    \
    X(0, 1, 0, 0, 1) /* Q3_K */
/* The formats with a factor a block (not Q6_K's or Q3_K's a sub-block of 16), for loops that take no other. */
#define LPD_BY_BLOCK(X)                                                                                            \
    X(0, 1, 0, 0, 0) /* int4 */                                                                                    \
    X(0, 0, 0, 0, 0) /* int8 */                                                                                    \
    X(1, 1, 0, 0, 0) /* codebooks */                                                                               \
    X(0, 1, 1, 0, 0) /* 5-bit */
/* LPD_CALL(F) (the caller's macro) with F the constant wfmt of the format f is among LIST's, else f itself. */
#define LPD_DISPATCH_IN(LIST, f)                                                                                   \
    do {                                                                                                           \
        const wfmt lpd_f = (f);                                                                                    \
        LIST(LPD_IF_FORMAT)                                                                                        \
        LPD_CALL(lpd_f);                                                                                           \
    } while (0)
#define LPD_DISPATCH(f) LPD_DISPATCH_IN(LPD_FORMATS, f)
#define LPD_DISPATCH_BY_BLOCK(f) LPD_DISPATCH_IN(LPD_BY_BLOCK, f)
#define LPD_IF_FORMAT(LUT, B4, HIGH, TOP, SC16)                                                                    \
    if (lpd_f.lut == LUT && lpd_f.b4 == B4 && lpd_f.high == HIGH && lpd_f.top == TOP && lpd_f.sc16 == SC16) {      \
        LPD_CALL(((wfmt){LUT, B4, HIGH, TOP, SC16}));                                                              \
        break;                                                                                                     \
    }
static inline int codebook_code(const uint8_t *wrow, int nb, int b, int j) { /* column j of block b's code */
    if ((nb & 1) && b == nb - 1) return (wrow[b * 16 + (j & 15)] >> (j & 16 ? 4 : 0)) & 15;
    return (wrow[b / 2 * 32 + j] >> (b & 1 ? 4 : 0)) & 15;
}
#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* Block b's 32 codes in column order (codebook_code's layout), each in a byte's low four bits. */
static inline __m256i codebook_block(const uint8_t *wrow, int nb, int b) {
    if ((nb & 1) && b == nb - 1) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(wrow + b * 16)), m = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
    }
    __m256i raw = _mm256_loadu_si256((const __m256i *)(wrow + b / 2 * 32));
    return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (b & 1))), _mm256_set1_epi8(15));
}
/* Sixteen fifth bits as bytes: byte i 16 where bit i of `bits` is set, else 0. */
static inline __m128i fifth_bytes(uint32_t bits) {
#if defined(LPD_AVX512)
    return _mm_maskz_mov_epi8((__mmask16)bits, _mm_set1_epi8(16));
#else
    const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    __m128i v = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), pick), bit);
    return _mm_and_si128(_mm_cmpeq_epi8(v, bit), _mm_set1_epi8(16));
#endif
}
/* Block j's (b & 3's) upper bits of the group bytes in u (upper_bytes128: 16 of them), each at bits 4 and 5 of its
 * byte (a code's): one shift and a mask where j is a constant (a caller that unrolls a group's four blocks), else a
 * shift by a count and one more. (16-bit shifts: the bits one moves across a byte fall outside the mask.) */
static inline __attribute__((always_inline)) __m256i upper_in_place(__m256i u, int j) {
    const __m256i m = _mm256_set1_epi8(0x30);
    if (__builtin_constant_p(j)) switch (j) {
        case 0: return _mm256_and_si256(_mm256_slli_epi16(u, 4), m);
        case 1: return _mm256_and_si256(_mm256_slli_epi16(u, 2), m);
        case 2: return _mm256_and_si256(u, m);
        default: return _mm256_and_si256(_mm256_srli_epi16(u, 2), m);
        }
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(u, _mm_cvtsi32_si128(2 * j)), 4), m);
}
static inline __attribute__((always_inline)) __m128i upper_bytes128(__m128i u, int j) {
    return _mm256_castsi256_si128(upper_in_place(_mm256_castsi128_si256(u), j));
}
static inline __attribute__((always_inline)) __m256i upper_bytes(const uint8_t *group, int j) {
    return upper_in_place(_mm256_loadu_si256((const __m256i *)group), j);
}
/* Block j's upper bits (its group's 32 bytes) into its 16 bytes of low and high codes (or_plane's for Q6_K). */
static inline __attribute__((always_inline)) void or_upper(__m128i *lo, __m128i *hi, const uint8_t *group, int j) {
    *lo = _mm_or_si128(*lo, upper_bytes128(_mm_loadu_si128((const __m128i *)group), j));
    *hi = _mm_or_si128(*hi, upper_bytes128(_mm_loadu_si128((const __m128i *)(group + 16)), j));
}
/* An int4 block's 32 codes (b of row wrow) as two registers of 16 bytes: its low nibbles (its even columns) and its
 * high ones (its odd columns), a 5-bit weight's fifth bits or Q6_K's upper ones added in. */
static inline __attribute__((always_inline)) void block_codes_as(const gemm_args *a, wfmt f, const uint8_t *wrow,
                                                                   int b, __m128i *lo, __m128i *hi) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(wrow + b * 16)), m = _mm_set1_epi8(15);
    *lo = _mm_and_si128(raw, m), *hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    if (f.high) {
        uint32_t f = fifth32(a, wrow, b);
        *lo = _mm_or_si128(*lo, fifth_bytes(f & 0xffff));
        *hi = _mm_or_si128(*hi, fifth_bytes(f >> 16));
    }
    if (f.top) or_upper(lo, hi, upper_of(a, wrow, b), b & 3);
}
static inline void block_codes(const gemm_args *a, const uint8_t *wrow, int b, __m128i *lo, __m128i *hi) {
    block_codes_as(a, fmt_of(a), wrow, b, lo, hi);
}
#endif

/* Integer sums of weight row `wrow` against activation rows xq[0..mm) (row stride K), all nb blocks: out[m * nb + b]. */
static void block_sums(const gemm_args *a, const uint8_t *wrow, const int8_t *xq, int mm, int32_t *out) {
    int K = a->K, nb = K / 32;
    for (int b = 0; b < nb; b++) {
#if defined(LPD_AVX512) || defined(LPD_AVX2)
        __m256i wv;
        if (a->lut) {
            __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a->lut));
            wv = _mm256_shuffle_epi8(tab, codebook_block(wrow, nb, b));
        } else if (a->bits == 4) {
            __m128i lo, hi;
            block_codes(a, wrow, b, &lo, &hi);
            wv = _mm256_set_m128i(hi, lo);
        } else {
            wv = _mm256_loadu_si256((const __m256i *)(wrow + b * 32));
        }
        for (int m = 0; m < mm; m++) {
            const int8_t *x = xq + (size_t)m * K + b * 32;
            __m256i xh = _mm256_loadu_si256((const __m256i *)x), xl = _mm256_loadu_si256((const __m256i *)(x + a->lo));
            __m256i wa = wv;
            if (signed_codes(a)) { /* |w| times x with w's sign */
                wa = _mm256_sign_epi8(wv, wv);
                xh = _mm256_sign_epi8(xh, wv);
                xl = _mm256_sign_epi8(xl, wv);
            }
            __m256i one = _mm256_set1_epi16(1);
            __m256i p = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(wa, xh), one), 8),
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xl), one));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            out[m * nb + b] = _mm_cvtsi128_si32(s4);
        }
#else
        for (int m = 0; m < mm; m++) {
            const int8_t *x = xq + (size_t)m * K + b * 32, *xl = x + a->lo;
            int32_t s = 0;
            if (a->lut) {
                for (int j = 0; j < 32; j++) s += a->lut[codebook_code(wrow, nb, b, j)] * (256 * x[j] + xl[j]);
            } else if (a->bits == 4) {
                const uint8_t *wb = wrow + b * 16;
                uint32_t f = a->high ? fifth32(a, wrow, b) : 0;
                const uint8_t *u = a->top ? upper_of(a, wrow, b) : NULL;
                int32_t half[2] = {0, 0}; /* Q6_K: sub-block 0 (columns 0 .. 15: bytes 0 .. 7), then 1 */
                for (int j = 0; j < 16; j++)
                    half[j >> 3] += ((wb[j] & 15) | (f >> j & 1) << 4 | (u ? upper_code(u[j], b & 3) : 0))
                                    * (256 * x[j] + xl[j])
                                    + ((wb[j] >> 4) | (f >> (16 + j) & 1) << 4 | (u ? upper_code(u[16 + j], b & 3) : 0))
                                      * (256 * x[16 + j] + xl[16 + j]);
                if (a->sc16) { /* two sums a block */
                    out[m * 2 * nb + 2 * b] = half[0], out[m * 2 * nb + 2 * b + 1] = half[1];
                    continue;
                }
                s = half[0] + half[1];
            } else {
                const int8_t *wb = (const int8_t *)wrow + b * 32;
                for (int j = 0; j < 32; j++) s += wb[j] * (256 * x[j] + xl[j]);
            }
            out[m * nb + b] = s;
        }
#endif
    }
}

#if defined(LPD_AVX512)
/* Two blocks at a time in 512-bit registers: acc[m] += float(sum of each block's products) * ds, per lane. */
static inline __m512i expand_int4_pair(const uint8_t *p) {
#if defined(__AVX512VBMI__) /* each block's 16 bytes twice (one vpermb), the second copy shifted: 3 operations, 1
                             * shuffle, where 5 with 2 shuffles took 10% longer (3072 x 576 in L3, one thread) */
    __m512i raw = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)); /* blocks b, b+1: 16 bytes each */
    const __m512i twice = _mm512_set_epi8(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                          31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                          15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
                                          15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i both = _mm512_permutexvar_epi8(twice, raw);
#if defined(__GFNI__) /* the shift and the mask in one operation: an affine map of each byte's bits over GF(2), the
                       * matrix a 64-bit lane's (bit i of the result from row i, byte 7 - i): bits 0-3 kept, or bits
                       * 4-7 moved down. The same bytes; one-row Q4_K and Q4_0 products 1.01x to 1.07x the rate (the
                       * Zen 4, where they are bound by their vector operations, not by memory: docs/PERF.md) */
    const long long low = 0x0102040800000000LL, high = 0x1020408000000000LL;
    return _mm512_gf2p8affine_epi64_epi8(both, _mm512_set_epi64(high, high, low, low, high, high, low, low), 0);
#else
    both = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
#endif
#else
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);                 /* blocks b, b+1: 16 bytes each */
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    both = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
#endif
    return _mm512_and_si512(both, _mm512_set1_epi8(15)); /* lo b, hi b, lo b+1, hi b+1 */
}
/* Weight blocks b, b + 1 of a row as 64 unsigned bytes for vpdpbusd: int4 codes as they are, int8 flipped by 128
 * (corrected by 128 x the input's sum, row_factors), a codebook's codes looked up in tab (lut_table): the pair's 32
 * bytes in both halves, the upper half shifted by 4 bits, and the low nibble of each byte looked up (vpermb takes
 * an index's low six bits, and the table fills all four of its 16-byte lanes, so the two bits above the nibble
 * pick a copy of it and need no mask). */
static inline __attribute__((always_inline)) __m512i load_pair_as(const gemm_args *a, wfmt f, const uint8_t *wrow,
                                                                   int b, __m512i tab) {
    if (f.lut) {
        __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wrow + b * 16)));
        __m512i idx = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
#if defined(__AVX512VBMI__)
        return _mm512_permutexvar_epi8(idx, tab);
#else
        return _mm512_shuffle_epi8(tab, _mm512_and_si512(idx, _mm512_set1_epi8(15)));
#endif
    }
    if (f.b4) {
        __m512i v = expand_int4_pair(wrow + b * 16);
        if (f.top) { /* Q6_K: b even, so b and b + 1 are blocks j, j + 1 of one upper group (upper_bytes' shifts) */
            __m512i u = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)upper_of(a, wrow, b)));
            long long s = 2 * (b & 3);
#if defined(__GFNI__) /* bits s, s + 1 of each byte (s + 2, s + 3 for block b + 1) to bits 4, 5 in one operation
                       * (expand_int4_pair's affine map), where a shift, a shift and a mask were three */
            long long m0 = (1LL << s) << 24 | (2LL << s) << 16, m1 = m0 << 2;
            return _mm512_or_si512(v, _mm512_gf2p8affine_epi64_epi8(u, _mm512_set_epi64(m1, m1, m1, m1, m0, m0, m0, m0),
                                                                    0));
#else
            u = _mm512_srlv_epi64(u, _mm512_set_epi64(s + 2, s + 2, s + 2, s + 2, s, s, s, s));
            return _mm512_or_si512(v, _mm512_and_si512(_mm512_slli_epi16(u, 4), _mm512_set1_epi8(0x30)));
#endif
        }
        if (!f.high) return v;
        const uint8_t *row = a->high + plane_row(a, wrow);
        __mmask64 f; /* the pair's fifth bits, bit e for byte e; b even, so a grouped pair is bits j, j + 1 of one
                      * group's 32 bytes: one test of them */
        if (b < fifth_grouped(a->K)) {
            int j = b % FIFTH_GROUP;
            __m512i g = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)fifth_group(row, b)));
            f = _mm512_test_epi8_mask(g, _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)),
                                                            _mm256_set1_epi8((char)(2 << j)), 1));
        } else {
            uint64_t w;
            memcpy(&w, row + 4 * (size_t)b, 8);
            f = _cvtu64_mask64(w);
        }
        return _mm512_mask_add_epi8(v, f, v, _mm512_set1_epi8(16)); /* a nibble + 16 */
    }
    return _mm512_xor_si512(_mm512_loadu_si512(wrow + b * 32), _mm512_set1_epi8((char)0x80));
}
static inline __m512i load_pair(const gemm_args *a, const uint8_t *wrow, int b, __m512i tab) {
    return load_pair_as(a, fmt_of(a), wrow, b, tab);
}
/* Each lane's four products of the weight bytes wv with the input's values, 256 x (with its high levels x) + (with
 * its low ones xl): the low products added onto the shifted high sums by the second vpdpbusd itself, where adding
 * two sums took a zeroed register and an add more (the integers, and so the floats, are the same): one-row products
 * of 16384 x 2048 took 0.90x (int4, 5-bit) to 0.99x (int8, Q6_K) the time out of the caches, 0.88x to 0.95x in
 * them (the 2-core Xeon). */
static inline __m512i hi_lo_sums(__m512i wv, __m512i x, __m512i xl) {
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, x), 8), wv, xl);
}
/* A codebook's values flipped by 128 (as int8 weights are), in each 128-bit lane; zeros without one. */
static inline __m512i lut_table(const gemm_args *a) {
    if (!a->lut) return _mm512_setzero_si512();
    return _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)a->lut), _mm_set1_epi8((char)0x80)));
}
#endif

#define ROWS_AT_ONCE 4
/* The factors' row stride in ds (row_factors): AVX512 stores whole registers of eight, past nb zeros, so a row never
 * shares a register's span with the next (a load over two stores of it waits for both to land). */
#if defined(LPD_AVX512)
#define DSTRIDE(nb) (((nb) + 7) & ~7)
#else
#define DSTRIDE(nb) (nb)
#endif
/* From this many input rows on, AVX512 takes the products in tiles of four weight rows and four input rows
 * (tile_rows); 2 to 15 rows take each weight row against all of them in one tile (gemm1x), its factors from
 * row_factors. In tiles of four input rows a fifth row and a ninth each started a tile of one input row, its
 * weights widened again and its factors a call of their own: 4 -> 5 rows added 0.175 ms and 8 -> 9 rows 0.210 to
 * SmolLM2-135M's four Q4_1 products, where each other row added 0.04 to 0.08 (the Zen 4 EPYC, one thread); in one
 * tile every row from the second adds 0.06 to 0.09 (docs/PERF.md, "a verification step's rows in one tile"). At 16
 * rows the tile's sums no longer fit in the registers. */
#define TILE_FROM 16
/* Row n's factors and terms for input rows m0 .. m0 + mm - 1 (defined below with the int4-k helpers). */
static void row_factors(const gemm_args *a, int n, int m0, int mm, int xor_blocks, float *ds, float *extra);

/* `bytes` from row on requested into L2, not L1, where L1 would not keep them until they are read (decode
 * attention's rows ahead: load_chunk; long weight rows' runs: plan_run). A prefetch never faults: past a page or a
 * buffer is harmless. */
static inline __attribute__((always_inline)) void prefetch_row(const char *row, int bytes) {
#if defined(__x86_64__) || defined(__i386__)
    for (int d = 0; d < bytes; d += 64) _mm_prefetch(row + d, _MM_HINT_T1);
#else
    (void)row, (void)bytes;
#endif
}

#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* The products take four weight rows at a time, a block or two of each in turn: four streams of a few hundred bytes
 * each, which the processor's own prefetcher does not follow (4 x 576-byte rows so read: 10 GB/s on one thread of
 * the Zen 4 EPYC, where one stream reads at 22). The four rows are one run of bytes, so each step requests the
 * `bytes` it reads WEIGHT_AHEAD further along that run (18 GB/s so; 4 to 16 KiB ahead alike, 32 less). gemm_tile
 * (several input rows) does the same: with a prefetch a row 8 rows ahead it read the output head (28 MB of int8,
 * out of the caches) at a third of gemv4's rate, even for one input row, so that a 2-row step's head cost 2.9x a
 * 1-row step's; with the run's prefetch 1.6x to 2x (one thread, Zen 4). */
#define WEIGHT_AHEAD 8192
/* Every prefetch helper is always_inline: gcc 12 finds a helper of nothing but prefetches free of effects and deletes
 * each call it does not inline, so that AVX2's one-row products read every weight byte unprefetched (the default
 * model's decode 1.6x slower on a Zen 3, docs/PERF.md); tests/kernels/test_cpu_compiled.py counts them in the
 * compiled products. */
static inline __attribute__((always_inline)) void prefetch_run(const uint8_t *run, size_t at, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(run + WEIGHT_AHEAD + at + o), _MM_HINT_T0);
}
/* Where four rows at a time (gemv1, gemv1_sub16, AVX2's gemv4) prefetch their run: WEIGHT_AHEAD along it, or from
 * the next four rows' start where four rows pass that (lead: the bytes further), so that every row of the next four
 * is requested before its first block is read; and into L2 (T1) where the input's two int8 levels and the bytes in
 * flight ahead (the codes' and a fifth or upper plane's) pass half a 32 KiB L1, where in L1 they pushed the input and
 * one another out before their use. SmolLM2-1.7B's down (K = 8192: 4 KiB rows of Q4_K) read 21-23 GB/s where its
 * other products read 31-34; so 28-31 (Q4_K, Q4_1, Q6_K; 2 threads, Zen 4; AVX2's Q4_K and Q4_1 20-22 -> 29 on the
 * same processor). group: the four rows' code bytes. */
typedef struct {
    size_t lead;
    int l2;
} run_plan;
static inline run_plan plan_run(size_t group, int K, wfmt f) {
    int quarters = f.top ? 6 : f.high ? 5 : 4; /* the codes' bytes and their plane's, in quarters of the codes' */
    run_plan p = {group > WEIGHT_AHEAD ? group - WEIGHT_AHEAD : 0, 0};
    p.l2 = 2 * (size_t)K + (p.lead + WEIGHT_AHEAD) * quarters / 4 > 16384;
    return p;
}
/* A 5-bit weight's fifth bits (a quarter of the codes' bytes) or Q6_K's upper ones (half) for prefetch_run's bytes of
 * a code run (rows one after another), as many blocks ahead; each line once, by the call whose bytes reach its
 * start. */
static inline __attribute__((always_inline)) void prefetch_fifth_as(const gemm_args *a, wfmt f, const uint8_t *run,
                                                                      size_t at, size_t bytes) {
    if (!f.high && !f.top) return;
    int per = f.top ? 2 : 4; /* code bytes a plane byte: Q6_K's upper bits, else a fifth bit */
    const uint8_t *plane = f.top ? a->top : a->high;
    size_t row = (size_t)(run - (const uint8_t *)a->w) / per;
    size_t from = (WEIGHT_AHEAD + at) / per, to = (WEIGHT_AHEAD + at + bytes) / per;
    if (f.top && bytes <= 128) { /* at most a line's upper bytes a call (calls one after another along the run, as
                                  * gemv4's and the tiles' blocks): the line where they start, without the loop's
                                  * arithmetic (a twentieth of AVX2's Q6_K loop) */
        _mm_prefetch((const char *)(plane + row + from), _MM_HINT_T0);
        return;
    }
    for (size_t o = (from + 63) & ~(size_t)63; o < to; o += 64)
        _mm_prefetch((const char *)(plane + row + o), _MM_HINT_T0);
}
/* prefetch_run's and prefetch_fifth_as' bytes of the four rows' run as plan_run says: `lead` further, the codes into
 * L2 where it says so. */
static inline __attribute__((always_inline)) void prefetch_group(const gemm_args *a, wfmt f, run_plan p,
                                                                   const uint8_t *run, size_t at, size_t bytes) {
    if (p.l2) prefetch_row((const char *)(run + p.lead + WEIGHT_AHEAD + at), (int)bytes);
    else prefetch_run(run + p.lead, at, bytes);
    prefetch_fifth_as(a, f, run + p.lead, at, bytes);
}
static inline __attribute__((always_inline)) void prefetch_fifth(const gemm_args *a, const uint8_t *run, size_t at,
                                                                   size_t bytes) {
    prefetch_fifth_as(a, fmt_of(a), run, at, bytes);
}
static inline __attribute__((always_inline)) void prefetch_lines(const void *p, size_t bytes) {
    uintptr_t at = (uintptr_t)p & ~(uintptr_t)63, end = (uintptr_t)p + bytes;
    for (; at < end; at += 64) _mm_prefetch((const char *)at, _MM_HINT_T0);
}
/* The factor arrays of weight rows n .. n + rows - 1 (scales, int4 biases, int4-k's d, dmin and group bytes, Q6_K's
 * sub-block scales): streams apart from the codes, an eighth of an int4-g32 weight's bytes, that row_factors read
 * unprefetched (with this, one-row products out of the caches 0.95x the time on the Zen 3); FACTOR_AHEAD rows
 * ahead. */
#define FACTOR_AHEAD 8
static inline __attribute__((always_inline)) void prefetch_factors(const gemm_args *a, int n, int rows) {
    if (n + rows > a->N) rows = a->N - n;
    if (rows <= 0) return;
    int K = a->K, nb = K / 32;
    if (a->sc16) {
        prefetch_lines(a->scales + (size_t)n * (K / 256), (size_t)rows * (K / 256) * 2);
        prefetch_lines(a->sc16 + (size_t)n * (K / 16), (size_t)rows * (K / 16));
        if (a->mn16) {
            prefetch_lines(a->biases + (size_t)n * (K / 256), (size_t)rows * (K / 256) * 2);
            prefetch_lines(a->mn16 + (size_t)n * (K / 16), (size_t)rows * (K / 16));
        }
    } else if (a->sub) {
        size_t ns = (nb + 7) / 8;
        prefetch_lines(a->scales + n * ns, rows * ns * 2);
        prefetch_lines(a->biases + n * ns, rows * ns * 2);
        prefetch_lines(a->sub + (size_t)n * 2 * nb, (size_t)rows * 2 * nb);
    } else {
        size_t ng = K / a->group;
        prefetch_lines(a->scales + n * ng, rows * ng * 2);
        if (deinterleaved(a->bits, a->lut) && a->biases) prefetch_lines(a->biases + n * ng, rows * ng * 2);
    }
}
#endif

#if defined(LPD_AVX512)
/* A pair's factors (blocks b, b + 1 of a row's, at f) out to their lanes (pair_pick): two, or Q6_K's four. The tiles
 * and gemm1x4 take them so; the one-row products (gemv1, gemv1_sub16) pick them from registers in the same lanes. */
static inline __m512i pair_pick(int sub16) {
    return sub16 ? _mm512_set_epi32(3, 3, 2, 2, 3, 3, 2, 2, 1, 1, 0, 0, 1, 1, 0, 0)
                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
}
static inline __m512 pair_factors(const float *f, int b, int sub16, __m512i pick) {
    __m128 v = sub16 ? _mm_loadu_ps(f + 2 * b) : _mm_castpd_ps(_mm_load_sd((const double *)(f + b)));
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(v));
}
#endif

#if defined(LPD_AVX512)
/* Weight row n against input rows m0 .. m0 + mm - 1 (mm <= 4; a missing row repeats the first and is not stored),
 * every block in a pair: each expanded pair of weight blocks serves the four rows, their sums in registers. */
static void gemm1x4(const gemm_args *a, int n, int m0, int mm, const float *ds, const float *extra) {
    int K = a->K, nb = K / 32;
    size_t row_bytes = a->bits == 4 ? K / 2 : K;
    const uint8_t *wrow = a->w + (size_t)n * row_bytes;
    const int8_t *x[4];
    const float *d[4];
    for (int m = 0; m < 4; m++) {
        int r = m < mm ? m : 0;
        x[m] = a->xq + (size_t)(m0 + r) * K;
        d[m] = ds + r * DSTRIDE(factor_count(a));
    }
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i tab = lut_table(a);
    for (int b = 0; b < nb; b += 2) {
        __m512i wv = load_pair(a, wrow, b, tab);
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++) {
            __m512i p = hi_lo_sums(wv, _mm512_loadu_si512(x[m] + b * 32), _mm512_loadu_si512(x[m] + a->lo + b * 32));
            __m512 f = a->sc16 ? pair_factors(d[m], b, 1, pair_pick(1))
                               : _mm512_insertf32x8(_mm512_set1_ps(d[m][b]), _mm256_set1_ps(d[m][b + 1]), 1);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[m]);
        }
    }
    for (int m = 0; m < mm; m++) a->y[(size_t)(m0 + m) * a->N + n] = _mm512_reduce_add_ps(acc[m]) + extra[m];
}
#endif

#if defined(LPD_AVX512)
/* Weight rows n .. n + R - 1 against input rows m0 .. m0 + MM - 1 (R and MM constants where it is inlined: 4 x 1..4
 * or 1 x 2..15, the R x MM sums in registers): each expanded pair of weight blocks serves the MM input rows and each
 * pair of input blocks the R weight rows. Each (weight row, input row) takes the one-row products' sums (gemv1's),
 * scaled and added in their order, so a row's result does not depend on how many rows share the step, nor on the
 * tile it falls in (a verification step's rows are the decode rows they check); a pair's two factors go out to their
 * lanes in one permute. ds[(r * rstride + m) * dstride + b] and extra[r * rstride + m]: the factors and terms of
 * weight row n + r and input row m0 + m.
 * The input goes in whole, each value the int16 256 hi + lo (xw, widen_row), against the weight's bytes widened to
 * int16 once a tile: vpmaddwd and vpdpwssd give each int32 lane the four products gemv1's vpdpbusd sums (lane l:
 * bytes 4l .. 4l + 3 of the pair; the first takes bytes 4l, 4l + 1, the second 4l + 2, 4l + 3), so the lanes, and
 * the floats, are gemv1's exactly (|256 hi + lo| < 2^15, a weight byte < 2^8: no lane overflows), in two multiplies
 * where two vpdpbusd, a shift and a zeroed register took four. */
static inline __attribute__((always_inline)) void gemm_tile(const gemm_args *a, int n, int m0, const int R, const int MM,
                                                             const float *ds, int dstride, int rstride,
                                                             const float *extra, const int SUB16) {
    int K = a->K, nb = K / 32;
    size_t row_bytes = a->bits == 4 ? K / 2 : K, step = a->bits == 4 ? 16 : 32;
    const uint8_t *w0 = a->w + (size_t)n * row_bytes;
    const __m512i pick = pair_pick(SUB16), tab = lut_table(a);
    const __m512i first = _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1));
    const __m512i second = _mm512_broadcast_i32x4(_mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1));
    __m512 acc[4][TILE_FROM - 1]; /* R x MM of them: 4 x 4 or 1 x 15 at most */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) acc[r][m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        __m512i wa[4], wb[4];
        prefetch_run(w0, b * R * step, 2 * R * step);
        prefetch_fifth(a, w0, b * R * step, 2 * R * step);
        for (int r = 0; r < R; r++) {
            __m512i wv = load_pair(a, w0 + r * row_bytes, b, tab);
            wa[r] = _mm512_shuffle_epi8(wv, first);
            wb[r] = _mm512_shuffle_epi8(wv, second);
        }
        for (int m = 0; m < MM; m++) {
            const int16_t *xm = a->xw + (size_t)(m0 + m) * K + b * 32; /* the pair's values at 4l, 4l + 1, then at
                                                                       * 4l + 2, 4l + 3 */
            __m512i x = _mm512_loadu_si512(xm), xl = _mm512_loadu_si512(xm + 32);
            for (int r = 0; r < R; r++) {
                __m512i p = _mm512_dpwssd_epi32(_mm512_madd_epi16(wa[r], x), wb[r], xl);
                __m512 f = pair_factors(ds + (size_t)(r * rstride + m) * dstride, b, SUB16, pick);
                acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++)
            a->y[(size_t)(m0 + m) * a->N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + extra[r * rstride + m];
}

/* 32 input values whole, each the int16 256 hi + lo (|.| < 2^15): what gemm_tile and the prefill GEMM multiply. */
static inline __m512i whole32(const int8_t *hi, const int8_t *lo) {
    return _mm512_add_epi16(_mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)hi)), 8),
                            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)lo)));
}

/* An input row's pairs of blocks as gemm_tile takes them: of each pair's 64 values (256 hi + lo, in xq's order),
 * those at 4l and 4l + 1 (l = 0 .. 15) first, then those at 4l + 2 and 4l + 3. */
static void widen_row(const int8_t *hi, const int8_t *lo, int K, int16_t *out) {
    const __m512i first = _mm512_set_epi16(61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32,
                                           29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(2));
    for (int k = 0; k < K; k += 64) {
        __m512i v0 = whole32(hi + k, lo + k), v1 = whole32(hi + k + 32, lo + k + 32);
        _mm512_storeu_si512(out + k, _mm512_permutex2var_epi16(v0, first, v1));
        _mm512_storeu_si512(out + k + 32, _mm512_permutex2var_epi16(v0, second, v1));
    }
}

/* gemm_tile of four weight rows and mm input rows (1 to 4). */
static void gemm4x(const gemm_args *a, int n, int m0, int mm, const float *ds, int dstride, const float *extra) {
    switch (mm) {
    case 1: gemm_tile(a, n, m0, 4, 1, ds, dstride, 4, extra, 0); break;
    case 2: gemm_tile(a, n, m0, 4, 2, ds, dstride, 4, extra, 0); break;
    case 3: gemm_tile(a, n, m0, 4, 3, ds, dstride, 4, extra, 0); break;
    default: gemm_tile(a, n, m0, 4, 4, ds, dstride, 4, extra, 0); break;
    }
}

/* Weight rows n .. n1 - 1, each in a gemm_tile of one weight row and all M input rows (2 to 15), on whole int16
 * inputs (xw), its factors and terms from row_factors in ds (the thread's scratch). The loop over the weight rows
 * is inside each tile's case, so that what does not change from one weight row to the next (the inputs' addresses,
 * the constants) is set up once, not once a row (a call a row cost 5 to 8 rows 5% to 8% more). */
static inline __attribute__((always_inline)) void gemm1x_rows(const gemm_args *a, int n, int n1, int xor_blocks,
                                                               float *ds, const int SUB16) {
    int dstride = DSTRIDE(factor_count(a));
    float extra[TILE_FROM - 1];
#define LPD_TILE(MM)                                                                                               \
    case MM:                                                                                                       \
        for (; n < n1; n++) {                                                                                      \
            row_factors(a, n, 0, MM, xor_blocks, ds, extra);                                                       \
            gemm_tile(a, n, 0, 1, MM, ds, dstride, 0, extra, SUB16);                                               \
        }                                                                                                          \
        break;
    switch (a->M) {
        LPD_TILE(2) LPD_TILE(3) LPD_TILE(4) LPD_TILE(5) LPD_TILE(6) LPD_TILE(7) LPD_TILE(8)
        LPD_TILE(9) LPD_TILE(10) LPD_TILE(11) LPD_TILE(12) LPD_TILE(13) LPD_TILE(14) LPD_TILE(15)
    }
#undef LPD_TILE
}
static void gemm1x(const gemm_args *a, int n, int n1, int xor_blocks, float *ds) {
    if (a->sc16) gemm1x_rows(a, n, n1, xor_blocks, ds, 1);
    else gemm1x_rows(a, n, n1, xor_blocks, ds, 0);
}
#endif

#if defined(LPD_AVX2)
/* AVX2's products take each input value whole, as the int16 256 hi + lo (exact: |256 hi + lo| < 2^15), against
 * the weight's codes widened to int16: vpmaddwd sums a pair of products into each int32 lane, two multiplies a
 * block where pmaddubsw on each int8 level took four (and four more instructions to join the levels). A lane's sum
 * is at most 4 x 128 x 32639 < 2^24: exact in float too. */
/* 32 bits as 32 bytes, byte i `value` where bit i is set, else 0: a block's fifth bits in the order of its
 * codes as one register holds them (low nibbles, then high), in 5 operations where fifth_bytes' two halves took 8. */
static inline __m256i plane_bytes(uint32_t bits, __m256i value) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), value);
}
/* Block j's (b % FIFTH_GROUP's) fifth bits of the group bytes in u (16 of them widened to 16-bit lanes), each at bit
 * 4 of its lane (a code's): one shift and a mask where j is a constant (a caller that unrolls a group's blocks),
 * else two shifts and a mask. */
static inline __attribute__((always_inline)) __m256i fifth_in_place(__m256i u, int j) {
    const __m256i m = _mm256_set1_epi16(16);
    if (__builtin_constant_p(j)) {
        if (j < 4) return _mm256_and_si256(_mm256_slli_epi16(u, 4 - j), m);
        if (j == 4) return _mm256_and_si256(u, m);
        return _mm256_and_si256(_mm256_srli_epi16(u, j - 4), m);
    }
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(u, _mm_cvtsi32_si128(j)), 4), m);
}
/* Block b's codes widened to int16: w0 the block's even columns, w1 its odd ones (as the input's x0, x1). j: b & 3,
 * Q6_K's place in its upper group (a constant where the caller unrolls a group's blocks). */
static inline __attribute__((always_inline)) void widen16_as(const gemm_args *a, wfmt f, const uint8_t *wrow, int b,
                                                               int j, __m128i tab, __m256i *w0, __m256i *w1) {
    if (f.b4 && f.top && !f.high && !f.lut) { /* Q6_K: the nibbles as below, each half's upper bits
                                                 * widened from its 16 bytes of the group (the same two loads
                                                 * for the group's four blocks) */
        const uint8_t *g = upper_of(a, wrow, b);
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wrow + b * 16)));
        __m256i u0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g));
        __m256i u1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 16)));
        *w0 = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(15)), upper_in_place(u0, j));
        *w1 = _mm256_or_si256(_mm256_srli_epi16(v, 4), upper_in_place(u1, j));
    } else if (f.b4 && f.high && !f.top && !f.lut && b < fifth_grouped(a->K)) { /* 5-bit codes in a group: the
                                                                                  * nibbles as below, each half's
                                                                                  * fifth bits widened from its 16
                                                                                  * bytes of the group */
        const uint8_t *g = fifth_group(a->high + plane_row(a, wrow), b);
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wrow + b * 16)));
        __m256i u0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g));
        __m256i u1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 16)));
        *w0 = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi16(15)), fifth_in_place(u0, b % FIFTH_GROUP));
        *w1 = _mm256_or_si256(_mm256_srli_epi16(v, 4), fifth_in_place(u1, b % FIFTH_GROUP));
    } else if (f.b4 && (f.high || f.top) && !f.lut) { /* 5-bit codes past a row's groups (or any of a weight with
                                                        * both planes): block_codes_as's, their bits added in one
                                                        * register */
        __m128i raw = _mm_loadu_si128((const __m128i *)(wrow + b * 16)), m = _mm_set1_epi8(15);
        __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
        if (f.high) c = _mm256_or_si256(c, plane_bytes(fifth32(a, wrow, b), _mm256_set1_epi8(16)));
        if (f.top) c = _mm256_or_si256(c, upper_bytes(upper_of(a, wrow, b), j));
        *w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c));
        *w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1));
    } else if (f.lut) { /* the block's 32 values in column order, as an int8 block's bytes */
        __m256i v = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(tab), codebook_block(wrow, a->K / 32, b));
        *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
    } else if (f.b4) { /* low nibbles: the block's even columns (x0), high: its odd ones (x1); each byte widened
                        * first, so that one mask and one shift split all 16 (where masks and a shift on the bytes
                        * and two widenings took six operations) */
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wrow + b * 16)));
        *w0 = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *w1 = _mm256_srli_epi16(v, 4);
    } else {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(wrow + b * 32));
        *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
        *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
    }
}
static inline __attribute__((always_inline)) __m256i dot16_as(const gemm_args *a, wfmt f, const uint8_t *wrow, int b,
                                                              int j, __m256i x0, __m256i x1, __m128i tab) {
    __m256i w0, w1;
    widen16_as(a, f, wrow, b, j, tab, &w0, &w1);
    return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
}
static inline __m256i dot16(const gemm_args *a, const uint8_t *wrow, int b, __m256i x0, __m256i x1, __m128i tab) {
    return dot16_as(a, fmt_of(a), wrow, b, b & 3, x0, x1, tab);
}

/* Block b's factor in the eight lanes of its products (dot16's): its one factor, or Q6_K's two (dm: a row's). */
static inline __attribute__((always_inline)) __m256 block_factor_as(wfmt f, const float *dm, int b) {
    if (!f.sc16) return _mm256_set1_ps(dm[b]);
    /* the pair as one 8-byte load, each spread over its four lanes by one permute (where two broadcasts and an
     * insert took three operations) */
    const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m128 pair = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(dm + 2 * b)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), pick);
}
static inline __m256 block_factor(const gemm_args *a, const float *dm, int b) { return block_factor_as(fmt_of(a), dm, b); }

/* A codebook's 16 values for vpshufb (zeros without one). */
static inline __m128i lut_table(const gemm_args *a) {
    return a->lut ? _mm_loadu_si128((const __m128i *)a->lut) : _mm_setzero_si128();
}

/* Block `second` (0 or 1, a constant) of a codebook pair whose 32 bytes are raw (codebook_code's layout), looked up in
 * tab2 (lut_table's, in both lanes) and widened to int16 as widen16_as's: w0 its columns 0-15, w1 16-31. */
static inline __attribute__((always_inline)) void codebook_pair_block(__m256i raw, int second, __m256i tab2,
                                                                        __m256i *w0, __m256i *w1) {
    __m256i codes = _mm256_and_si256(second ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
    __m256i v = _mm256_shuffle_epi8(tab2, codes);
    *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

/* gemv4_as's step: block b (j = b & 3) of the four rows w into their sums acc. */
static inline __attribute__((always_inline)) void gemv4_block(const gemm_args *a, wfmt f, const uint8_t *const *w,
                                                                int b, int j, const float *ds, __m128i tab,
                                                                run_plan ahead, __m256 *acc) {
    int fc = f.sc16 ? a->K / 16 : a->K / 32;
    size_t step = f.b4 ? 64 : 128; /* the four rows' bytes a block */
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->x16 + b * 32));
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->x16 + b * 32 + 16));
    prefetch_group(a, f, ahead, w[0], b * step, step);
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16_as(a, f, w[r], b, j, x0, x1, tab)),
                                 block_factor_as(f, ds + r * fc, b), acc[r]);
    }
}
/* Rows n .. n + 3 against input row 0, the input's blocks loaded once for the four; f: a's format (gemv4). Q6_K
 * (K a multiple of 256) a step of its upper group's four blocks, so that each one's shifts are constants: its
 * one-row products of SmolLM2-1.7B's shapes out of the caches took 0.6x to 0.7x the time of a plane a bit (the
 * Zen 3, 1 and 2 threads; docs/PERF.md). */
static inline __attribute__((always_inline)) void gemv4_as(const gemm_args *a, wfmt f, int n, const float *ds,
                                                           const float *extra) {
    int K = a->K, nb = K / 32;
    size_t row_bytes = f.b4 ? K / 2 : K;
    const uint8_t *w[4] = {a->w + (size_t)n * row_bytes, a->w + (size_t)(n + 1) * row_bytes,
                           a->w + (size_t)(n + 2) * row_bytes, a->w + (size_t)(n + 3) * row_bytes};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m128i tab = lut_table(a);
    const run_plan ahead = plan_run(4 * row_bytes, K, f);
    if (f.top && !f.high && !f.lut) { /* Q6_K: a group of four blocks a row at a time, its upper bits widened
                                        * once for the four (widen16_as's codes, the inputs read again a row) */
        const uint8_t *up[4] = {upper_of(a, w[0], 0), upper_of(a, w[1], 0), upper_of(a, w[2], 0),
                                upper_of(a, w[3], 0)};
        const __m256i m = _mm256_set1_epi16(15);
        int fc = K / 16;
        for (int b = 0; b < nb; b += 4) {
            for (int j = 0; j < 4; j++) {
                prefetch_group(a, f, ahead, w[0], (b + j) * 64, 64);
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const uint8_t *g = up[r] + 8 * (size_t)b;
                __m256i u0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g));
                __m256i u1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 16)));
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const int16_t *x = a->x16 + (b + j) * 32;
                    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + (b + j) * 16)));
                    __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, m), upper_in_place(u0, j));
                    __m256i w1 = _mm256_or_si256(_mm256_srli_epi16(v, 4), upper_in_place(u1, j));
                    __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), block_factor_as(f, ds + r * fc, b + j), acc[r]);
                }
            }
        }
    } else if (f.high && !f.top && !f.lut) { /* 5-bit codes: a group of eight blocks a row at a time, its fifth
                                               * bits widened once for the eight (widen16_as's codes), then the
                                               * blocks past the groups one at a time */
        const __m256i m = _mm256_set1_epi16(15);
        int full = fifth_grouped(K), fc = K / 32;
        for (int gi = 0; gi < full / FIFTH_GROUP; gi++) {
            int b = gi * FIFTH_GROUP;
            for (int j = 0; j < FIFTH_GROUP; j++) {
                prefetch_group(a, f, ahead, w[0], (b + j) * 64, 64);
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const uint8_t *g = fifth_group(a->high + plane_row(a, w[r]), b);
                __m256i u0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)g));
                __m256i u1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 16)));
#pragma GCC unroll 8
                for (int j = 0; j < FIFTH_GROUP; j++) {
                    const int16_t *x = a->x16 + (b + j) * 32;
                    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + (b + j) * 16)));
                    __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, m), fifth_in_place(u0, j));
                    __m256i w1 = _mm256_or_si256(_mm256_srli_epi16(v, 4), fifth_in_place(u1, j));
                    __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ds[r * fc + b + j]), acc[r]);
                }
            }
        }
        for (int b = full; b < nb; b++) gemv4_block(a, f, w, b, b & 3, ds, tab, ahead, acc);
    } else if (f.lut && !f.top && !f.high) { /* a codebook: a pair of blocks a row from its one 32-byte load, split
                                               * into the two blocks' codes by constant shifts, where each block
                                               * loaded the pair again and shifted it by a count (gemv4_block's
                                               * codebook_block: about 27 instructions a block a row, 13.6 here, gcc
                                               * 12 for a Zen 3), the sums in gemv4_block's order */
        const __m256i tab2 = _mm256_broadcastsi128_si256(tab);
        const int fc = K / 32;
        for (int b = 0; b + 2 <= nb; b += 2) {
            const int16_t *x = a->x16 + b * 32;
            __m256i x00 = _mm256_loadu_si256((const __m256i *)x), x01 = _mm256_loadu_si256((const __m256i *)(x + 16));
            __m256i x10 = _mm256_loadu_si256((const __m256i *)(x + 32));
            __m256i x11 = _mm256_loadu_si256((const __m256i *)(x + 48));
            prefetch_group(a, f, ahead, w[0], b * 64, 128);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(w[r] + b * 16)), a0, a1, b0, b1;
                codebook_pair_block(raw, 0, tab2, &a0, &a1);
                codebook_pair_block(raw, 1, tab2, &b0, &b1);
                __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(a0, x00), _mm256_madd_epi16(a1, x01));
                __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(b0, x10), _mm256_madd_epi16(b1, x11));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(ds[r * fc + b]), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(ds[r * fc + b + 1]), acc[r]);
            }
        }
        if (nb & 1) gemv4_block(a, f, w, nb - 1, (nb - 1) & 3, ds, tab, ahead, acc); /* a last odd block: 16 bytes */
    } else if (f.top) {
        for (int b = 0; b < nb; b += 4) {
            gemv4_block(a, f, w, b, 0, ds, tab, ahead, acc);
            gemv4_block(a, f, w, b + 1, 1, ds, tab, ahead, acc);
            gemv4_block(a, f, w, b + 2, 2, ds, tab, ahead, acc);
            gemv4_block(a, f, w, b + 3, 3, ds, tab, ahead, acc);
        }
    } else {
        for (int b = 0; b < nb; b++) gemv4_block(a, f, w, b, b & 3, ds, tab, ahead, acc);
    }
    for (int r = 0; r < 4; r++) a->y[n + r] = hsum8(acc[r]) + extra[r];
}
/* (A function of its own, whose loops tests/kernels/test_cpu_compiled.py reads.) */
static __attribute__((noinline)) void gemv4(const gemm_args *a, int n, const float *ds, const float *extra) {
#define LPD_CALL(F) gemv4_as(a, F, n, ds, extra)
    LPD_DISPATCH(fmt_of(a));
#undef LPD_CALL
}

/* Weight row n against input rows m0 .. m0 + MM - 1 (MM a constant where it is inlined, up to AVX2_ROWS): the
 * weight's block widened once for the MM rows, their sums in registers, each row's the ops of its gemv4 in the same
 * order (so each row is its one-row product). ds[m * nb + b], extra[m]: row_factors' for input row m0 + m; f: a's
 * format (gemm16x). */
#define AVX2_ROWS 8
/* tile16_block's products: block b's codes w0, w1 (widen16_as's) against the MM rows into their sums acc. */
static inline __attribute__((always_inline)) void tile16_widened(const gemm_args *a, wfmt f, int b, int m0,
                                                                   const int MM, const float *ds, __m256i w0,
                                                                   __m256i w1, __m256 *acc) {
    int K = a->K, fc = f.sc16 ? K / 16 : K / 32;
    for (int m = 0; m < MM; m++) {
        const int16_t *x = a->x16 + (size_t)(m0 + m) * K + b * 32;
        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                     _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), block_factor_as(f, ds + m * fc, b), acc[m]);
    }
}
/* gemm_tile16_as's step: block b (j = b & 3) of weight row wrow against the MM rows into their sums acc. */
static inline __attribute__((always_inline)) void tile16_block(const gemm_args *a, wfmt f, const uint8_t *wrow,
                                                                 int b, int j, int m0, const int MM, const float *ds,
                                                                 __m128i tab, __m256 *acc) {
    size_t step = f.b4 ? 16 : 32;
    __m256i w0, w1;
    prefetch_run(wrow, b * step, step);
    prefetch_fifth_as(a, f, wrow, b * step, step);
    widen16_as(a, f, wrow, b, j, tab, &w0, &w1);
    tile16_widened(a, f, b, m0, MM, ds, w0, w1, acc);
}
static inline __attribute__((always_inline)) void gemm_tile16_as(const gemm_args *a, wfmt f, int n, int m0,
                                                                  const int MM, const float *ds, const float *extra) {
    int K = a->K, nb = K / 32;
    const uint8_t *wrow = a->w + (size_t)n * (f.b4 ? K / 2 : K);
    const __m128i tab = lut_table(a);
    __m256 acc[AVX2_ROWS];
    for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();
    if (f.top) { /* Q6_K: gemv4_as's steps of four blocks */
        for (int b = 0; b < nb; b += 4) {
            tile16_block(a, f, wrow, b, 0, m0, MM, ds, tab, acc);
            tile16_block(a, f, wrow, b + 1, 1, m0, MM, ds, tab, acc);
            tile16_block(a, f, wrow, b + 2, 2, m0, MM, ds, tab, acc);
            tile16_block(a, f, wrow, b + 3, 3, m0, MM, ds, tab, acc);
        }
    } else if (f.lut && !f.top && !f.high) { /* a codebook: a pair of blocks from one load (gemv4_as's) */
        const __m256i tab2 = _mm256_broadcastsi128_si256(tab);
        for (int b = 0; b + 2 <= nb; b += 2) {
            prefetch_run(wrow, b * 16, 32);
            __m256i raw = _mm256_loadu_si256((const __m256i *)(wrow + b * 16)), w0, w1;
            codebook_pair_block(raw, 0, tab2, &w0, &w1);
            tile16_widened(a, f, b, m0, MM, ds, w0, w1, acc);
            codebook_pair_block(raw, 1, tab2, &w0, &w1);
            tile16_widened(a, f, b + 1, m0, MM, ds, w0, w1, acc);
        }
        if (nb & 1) tile16_block(a, f, wrow, nb - 1, (nb - 1) & 3, m0, MM, ds, tab, acc);
    } else {
        for (int b = 0; b < nb; b++) tile16_block(a, f, wrow, b, b & 3, m0, MM, ds, tab, acc);
    }
    for (int m = 0; m < MM; m++) a->y[(size_t)(m0 + m) * a->N + n] = hsum8(acc[m]) + extra[m];
}

/* AVX2's weight rows n .. n1 - 1 against 2 to 15 input rows: each weight row's factors for them all in one call,
 * then tiles of up to AVX2_ROWS input rows (sums in registers; its 16 registers hold 8 and the weight's block).
 * The loop this replaced took at most four input rows a pass, its sums in memory: 2 rows cost 3.0x one row's
 * products and each row after about 0.23 ms, where now 2 rows cost 1.7x and each row after 0.07 to 0.11 ms
 * (SmolLM2-135M's four Q4_1 products, a haswell build on the Zen 4 EPYC, one thread; docs/PERF.md, "a verification
 * step's rows in one tile"). Each format its own copy, as gemv4's. */
static inline __attribute__((always_inline)) void gemm16x_as(const gemm_args *a, wfmt f, int n, int n1,
                                                              int xor_blocks, float *ds) {
    float extra[TILE_FROM - 1];
    int chunks = (a->M + AVX2_ROWS - 1) / AVX2_ROWS, fc = f.sc16 ? a->K / 16 : a->K / 32;
    for (; n < n1; n++) {
        prefetch_factors(a, n + FACTOR_AHEAD, 1);
        row_factors(a, n, 0, a->M, xor_blocks, ds, extra);
        for (int c = 0; c < chunks; c++) {
            int m0 = a->M * c / chunks, mm = a->M * (c + 1) / chunks - m0;
            const float *d = ds + (size_t)m0 * fc, *e = extra + m0;
            switch (mm) {
            case 1: gemm_tile16_as(a, f, n, m0, 1, d, e); break;
            case 2: gemm_tile16_as(a, f, n, m0, 2, d, e); break;
            case 3: gemm_tile16_as(a, f, n, m0, 3, d, e); break;
            case 4: gemm_tile16_as(a, f, n, m0, 4, d, e); break;
            case 5: gemm_tile16_as(a, f, n, m0, 5, d, e); break;
            case 6: gemm_tile16_as(a, f, n, m0, 6, d, e); break;
            case 7: gemm_tile16_as(a, f, n, m0, 7, d, e); break;
            default: gemm_tile16_as(a, f, n, m0, 8, d, e); break;
            }
        }
    }
}
static __attribute__((noinline)) void gemm16x(const gemm_args *a, int n, int n1, int xor_blocks, float *ds) {
#define LPD_CALL(F) gemm16x_as(a, F, n, n1, xor_blocks, ds)
    LPD_DISPATCH(fmt_of(a));
#undef LPD_CALL
}
#endif

/* Row n's factors for input rows m0 .. m0 + mm - 1: ds[m * nb + b] = weight scale x input scale of block b, and
 * extra[m] = what is added to the scaled sums (int4 biases x the blocks' sums, AVX512's int8 correction for its
 * first xor_blocks blocks, the layer's bias). Eight blocks at a time from the float16 scales where a group is one
 * block (Q4_1's, Q8_0's), the rest one by one. */
/* int4-k's row n (quant/int4k.py): group b's scale is d[b / 8] x sc[b] and its bias dmin[b / 8] x mn[b]. */
typedef struct {
    const uint8_t *sc;
    const int8_t *mn;
    const uint16_t *d, *dmin;
} k_row;

static inline k_row k_row_at(const uint16_t *d, const uint16_t *dmin, const uint8_t *sub, int n, int nb) {
    size_t ns = (nb + 7) / 8;
    const uint8_t *sc = sub + (size_t)n * 2 * nb;
    return (k_row){sc, (const int8_t *)sc + nb, d + n * ns, dmin + n * ns};
}

/* The row's groups' scales and biases in float. */
static void k_group_scales(k_row r, int nb, float *ws, float *wb) {
    for (int b = 0; b < nb; b++)
        ws[b] = half_to_float(r.d[b / 8]) * (float)r.sc[b], wb[b] = half_to_float(r.dmin[b / 8]) * (float)r.mn[b];
}

/* Q6_K's row n, sub-block s: its scale d x sc, as ggml multiplies them (d: a float16 a super-block of 256 columns,
 * sc: an int8 a sub-block of 16). */
static inline float q6k_scale(const uint16_t *d, const int8_t *sc, int K, int n, int s) {
    return half_to_float(d[(size_t)n * (K / 256) + s / 16]) * (float)sc[(size_t)n * (K / 16) + s];
}
/* Q2_K's row n, sub-block s: its minimum dmin x mn (q6k_scale's product); 0 for Q6_K and Q3_K (mn NULL). */
static inline float q2k_minimum(const uint16_t *dmin, const int8_t *mn, int K, int n, int s) {
    return mn ? q6k_scale(dmin, mn, K, n, s) : 0.f;
}

#if defined(LPD_AVX512)
/* Row n's q6k_scale of sub-blocks s .. s + 15 (a super-block): d a super-block times v a sub-block. */
static inline __m512 scale16(const uint16_t *d, const int8_t *v, int K, int n, int s) {
    const int8_t *p = v + (size_t)n * (K / 16) + s;
    return _mm512_mul_ps(_mm512_set1_ps(half_to_float(d[(size_t)n * (K / 256) + s / 16])),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
}
/* Row n's d x sc of sub-blocks s .. s + 15, for q6k_factors and gemv1_sub16 alike. */
static inline __m512 q6k_side16(const gemm_args *a, int n, int s) { return scale16(a->scales, a->sc16, a->K, n, s); }
/* Q2_K's: row n's dmin x mn of sub-blocks s .. s + 15. */
static inline __m512 q2k_min16(const gemm_args *a, int n, int s) { return scale16(a->biases, a->mn16, a->K, n, s); }
#endif
/* Q6_K's (and Q3_K's, Q2_K's) row_factors, for every path (one function, so every row count gets the same floats):
 * ds[m * stride + s] = (d x sc of sub-block s) x the input block's scale, two a block; extra[m] = -term_times x the
 * sum of each sub-block's term factor times its integer input sum, plus the layer's bias. The term factor is ds's
 * (the codes q go in as they are, for q - offset: term_times = sub16_offset), Q2_K's its minimum dmin x mn times the
 * input block's scale (term_times 1). */
static inline float term_times(const gemm_args *a) {
    return a->mn16 ? 1.f : (float)sub16_offset(a->high, a->top, a->mn16);
}
static __attribute__((noinline)) void q6k_factors(const gemm_args *a, int n, int m0, int mm, int stride, float *ds,
                                                  float *extra) {
    int nb = a->K / 32, ns = 2 * nb;
#if defined(LPD_AVX2)
    const int8_t *sc = a->sc16 + (size_t)n * ns;
    const uint16_t *d = a->scales + (size_t)n * (a->K / 256);
#endif
    for (int m = 0; m < mm; m++) {
        const float *xd = a->xd + (size_t)(m0 + m) * nb;
        const int32_t *xs = a->xs16 + (size_t)(m0 + m) * ns;
        float *dm = ds + (size_t)m * stride, e;
#if defined(LPD_AVX512) /* a super-block (16 sub-blocks) a step: its d, the eight blocks' input scales twice each */
        const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        __m512 acc = _mm512_setzero_ps();
        for (int s = 0; s < ns; s += 16) {
            __m512 x2 = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(xd + s / 2)));
            __m512 f = _mm512_mul_ps(q6k_side16(a, n, s), x2);
            _mm512_storeu_ps(dm + s, f);
            __m512 t = a->mn16 ? _mm512_mul_ps(q2k_min16(a, n, s), x2) : f;
            acc = _mm512_fmadd_ps(t, _mm512_cvtepi32_ps(_mm512_loadu_si512(xs + s)), acc);
        }
        e = _mm512_reduce_add_ps(acc);
#elif defined(LPD_AVX2) /* a super-block a step (its d converted once), half of it a register, the four blocks'
                        * input scales twice each by one permute (where three operations took them); the same
                        * floats in the same order */
        const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        __m256 acc = _mm256_setzero_ps();
        for (int s = 0; s < ns; s += 16) {
            const __m256 dv = _mm256_set1_ps(half_to_float(d[s / 16]));
            for (int h = s; h < s + 16; h += 8) {
                __m128i sc8 = _mm_loadl_epi64((const __m128i *)(sc + h));
                __m256 w = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
                __m256 x8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(xd + h / 2)), twice);
                __m256 f = _mm256_mul_ps(w, x8), t = f;
                _mm256_storeu_ps(dm + h, f);
                if (a->mn16) { /* Q2_K's minima: dmin x mn, the same way */
                    __m128i mn8 = _mm_loadl_epi64((const __m128i *)(a->mn16 + (size_t)n * ns + h));
                    __m256 dmv = _mm256_set1_ps(half_to_float(a->biases[(size_t)n * (a->K / 256) + s / 16]));
                    t = _mm256_mul_ps(_mm256_mul_ps(dmv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn8))), x8);
                }
                acc = _mm256_fmadd_ps(t, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + h))), acc);
            }
        }
        e = hsum8(acc);
#else
        e = 0.f;
        for (int s = 0; s < ns; s++) {
            dm[s] = q6k_scale(a->scales, a->sc16, a->K, n, s) * xd[s >> 1];
            e += (a->mn16 ? q2k_minimum(a->biases, a->mn16, a->K, n, s) * xd[s >> 1] : dm[s]) * (float)xs[s];
        }
#endif
        extra[m] = -term_times(a) * e + (a->bias ? a->bias[n] : 0.f);
    }
}

#if defined(LPD_AVX512)
#define PAD16(n) (((n) + 15) & ~15)
static inline __mmask8 first_lanes(int n) { return n >= 8 ? 0xff : n > 0 ? (1u << n) - 1 : 0; }
static inline __mmask16 first16(int n) { return n >= 16 ? 0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0; }

/* int4-k's blocks b .. b + 7 of row r (lanes past k zero): ws = d x sc, wb = dmin x mn, as rounded here (an empty
 * asm keeps gcc's -fassociative-math from regrouping them with the caller's products, so that every path gets the
 * same floats). */
static inline void k_side8(k_row r, int b, __mmask8 k, __m256 *ws, __m256 *wb) {
    __m256 w = _mm256_mul_ps(_mm256_set1_ps(half_to_float(r.d[b / 8])),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, r.sc + b))));
    __m256 c = _mm256_mul_ps(_mm256_set1_ps(half_to_float(r.dmin[b / 8])),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, r.mn + b))));
    __asm__("" : "+x"(w), "+x"(c));
    *ws = w, *wb = c;
}

/* Blocks b .. b + 7 (b a multiple of 8) of weight row n: ws, each block's scale (int4-k: d x sc), and wb, what
 * multiplies the input block's sum (int4's bias, int4-k's dmin x mn; zeros for int8 and codebooks); lanes at or
 * past the row's nb blocks zero. row_factors (a few input rows) and weight_side (a tile's) both take a row's
 * factors from here, so that each input row gets the same floats whatever rows share the step. */
static inline void block_side8(const gemm_args *a, int n, int b, __m256 *ws, __m256 *wb) {
    int nb = a->K / 32, ng = a->K / a->group, per_group = a->group / 32;
    __mmask8 k = first_lanes(nb - b);
    if (a->sub) {
        k_side8(k_row_at(a->scales, a->biases, a->sub, n, nb), b, k, ws, wb);
        return;
    }
    const uint16_t *srow = a->scales + (size_t)n * ng;
    int with_b = deinterleaved(a->bits, a->lut); /* int4's biases, stored or symmetric */
    const uint16_t *brow = with_b && a->biases ? a->biases + (size_t)n * ng : NULL;
    const float sym = symmetric_bias(a->high);
    if (per_group == 1) {
        *ws = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, srow + b));
        *wb = brow ? _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, brow + b))
                   : with_b ? _mm256_mul_ps(*ws, _mm256_set1_ps(sym)) : _mm256_setzero_ps();
        return;
    }
    float s8[8], t8[8]; /* groups of several blocks: each block's group's values */
    for (int j = 0; j < 8; j++) {
        int in = b + j < nb, g = (in ? b + j : 0) / per_group;
        s8[j] = in ? half_to_float(srow[g]) : 0.f;
        t8[j] = in && brow ? half_to_float(brow[g]) : in && with_b ? sym * s8[j] : 0.f;
    }
    *ws = _mm256_loadu_ps(s8);
    *wb = _mm256_loadu_ps(t8);
}

/* block_side8 of blocks c .. c + 15, a row's factors ws and terms' side wb (zeros past the row: block_side8 reads no
 * factor of a block it is not given); a scale (and bias) a block sixteen converted at once, and int4-k's two
 * super-blocks at once where the chunk is whole: block_side8's floats, lane for lane. */
static inline __attribute__((always_inline)) void block_side16(const gemm_args *a, int n, int c, __m512 *ws,
                                                                __m512 *wb) {
    int nb = a->K / 32;
    if (!a->sub && a->group == 32) {
        __mmask16 k = first16(nb - c);
        __m512 w = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, a->scales + (size_t)n * nb + c));
        *ws = w;
        *wb = !deinterleaved(a->bits, a->lut) ? _mm512_setzero_ps()
              : a->biases ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, a->biases + (size_t)n * nb + c))
                          : _mm512_mul_ps(w, _mm512_set1_ps(symmetric_bias(a->high)));
        return;
    }
    if (a->sub && c + 16 <= nb) {
        k_row r = k_row_at(a->scales, a->biases, a->sub, n, nb);
        const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        uint32_t d2, m2;
        memcpy(&d2, r.d + c / 8, 4);
        memcpy(&m2, r.dmin + c / 8, 4);
        __m512 dv = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d2))));
        __m512 mv = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)m2))));
        __m512 w = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r.sc + c)))));
        __m512 m = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r.mn + c)))));
        __asm__("" : "+v"(w), "+v"(m));
        *ws = w, *wb = m;
        return;
    }
    __m256 w0, b0, w1 = _mm256_setzero_ps(), b1 = w1;
    block_side8(a, n, c, &w0, &b0);
    if (c + 8 < nb) block_side8(a, n, c + 8, &w1, &b1);
    *ws = _mm512_insertf32x8(_mm512_castps256_ps512(w0), w1, 1);
    *wb = _mm512_insertf32x8(_mm512_castps256_ps512(b0), b1, 1);
}

/* Weight row n's block_side8, all of it: ws[b] and wb[b], zeros up to PAD16(nb). */
static void weight_side(const gemm_args *a, int n, float *ws, float *wb) {
    int nb = a->K / 32, np = PAD16(nb);
    for (int b = 0; b < np; b += 8) {
        __m256 w8, b8;
        block_side8(a, n, b, &w8, &b8);
        _mm256_storeu_ps(ws + b, w8);
        _mm256_storeu_ps(wb + b, b8);
    }
}

/* AVX512: ds[m * nb + b] = ws[b] x the input block's scale; extra[m] = the sum of wb[b] x the block's sum (int4,
 * int4-k) or -128 x that of ds[b] x its integer sum over the first xor_blocks blocks (int8 and codebooks, whose
 * codes go in flipped by 128): block b in lane b % 8, eight blocks a step (the last masked), then hsum8's order;
 * plus the layer's bias. */
static void row_factors_grouped(const gemm_args *a, int n, int mm, int xor_blocks, float bias, const float *xd,
                                const float *xsf, const int32_t *xs, float *ds, float *extra);
static void row_factors(const gemm_args *a, int n, int m0, int mm, int xor_blocks, float *ds, float *extra) {
    if (a->sc16) {
        q6k_factors(a, n, m0, mm, DSTRIDE(factor_count(a)), ds, extra);
        return;
    }
    int nb = a->K / 32, ng = a->K / a->group, stride = DSTRIDE(nb);
    float bias = a->bias ? a->bias[n] : 0.f;
    const float *xd = a->xd + (size_t)m0 * nb, *xsf = a->xsf + (size_t)m0 * nb;
    const int32_t *xs = a->xsum + (size_t)m0 * nb;
    if (!a->sub && a->group == 32) { /* Q4_1's, Q8_0's and the codebooks' (block_side8's, written out) */
        const uint16_t *srow = a->scales + (size_t)n * ng;
        const uint16_t *brow = a->biases ? a->biases + (size_t)n * ng : NULL; /* int4's (else symmetric_bias's) */
        const __m256 sym = _mm256_set1_ps(symmetric_bias(a->high));
        int full = nb & ~7, xfull = xor_blocks & ~7;
        __mmask8 k = first_lanes(nb - full), kx = first_lanes(xor_blocks - full);
#define LPD_SCALES(b, k) _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, srow + (b)))
#define LPD_D8(b, k) _mm256_mul_ps(LPD_SCALES(b, k), _mm256_maskz_loadu_ps(k, xd + (b)))
#define LPD_BIASES(b, k)                                                                                           \
    (a->biases ? _mm256_cvtph_ps(_mm_maskz_loadu_epi16(k, brow + (b))) : _mm256_mul_ps(LPD_SCALES(b, k), sym))
        if (deinterleaved(a->bits, a->lut)) { /* int4: the biases times the blocks' sums */
            for (int m = 0; m < mm; m++, xd += nb, xsf += nb) {
                float *dm = ds + (size_t)m * stride;
                __m256 acc = _mm256_setzero_ps();
                int b = 0;
                for (; b < full; b += 8) {
                    _mm256_storeu_ps(dm + b, LPD_D8(b, 0xff));
                    acc = _mm256_fmadd_ps(LPD_BIASES(b, 0xff), _mm256_loadu_ps(xsf + b), acc);
                }
                if (k) {
                    _mm256_storeu_ps(dm + b, LPD_D8(b, k)); /* zeros past nb */
                    acc = _mm256_fmadd_ps(LPD_BIASES(b, k), _mm256_maskz_loadu_ps(k, xsf + b), acc);
                }
                extra[m] = hsum8(acc) + bias;
            }
        } else { /* int8 and codebooks: -128 x the factors times the blocks' integer sums */
            for (int m = 0; m < mm; m++, xd += nb, xs += nb) {
                float *dm = ds + (size_t)m * stride;
                __m256 acc = _mm256_setzero_ps();
                int b = 0;
                for (; b < full; b += 8) {
                    __m256 d8 = LPD_D8(b, 0xff);
                    _mm256_storeu_ps(dm + b, d8);
                    __mmask8 kb = b < xfull ? 0xff : kx;
                    acc = _mm256_fmadd_ps(d8, _mm256_cvtepi32_ps(_mm256_maskz_loadu_epi32(kb, xs + b)), acc);
                }
                if (k) {
                    __m256 d8 = LPD_D8(b, k);
                    _mm256_storeu_ps(dm + b, d8);
                    acc = _mm256_fmadd_ps(d8, _mm256_cvtepi32_ps(_mm256_maskz_loadu_epi32(b < xfull ? 0xff : kx, xs + b)), acc);
                }
                extra[m] = -128.f * hsum8(acc) + bias;
            }
        }
#undef LPD_BIASES
#undef LPD_D8
#undef LPD_SCALES
        return;
    }
    if (a->sub && mm == 1) { /* int4-k at one row (decode): row_factors_grouped's floats, the row looked up once */
        k_row r = k_row_at(a->scales, a->biases, a->sub, n, nb);
        __m256 acc = _mm256_setzero_ps();
        int b = 0;
        /* two super-blocks a step in 512-bit registers: k_side8's products, lane for lane (its d and dmin in float,
         * times each group's byte in float, kept apart by the empty asm), the terms summed eight lanes at a time in
         * its order; where eight a step took 1.3x int4-g32's one-row products of the same width */
        for (; b + 16 <= nb; b += 16) {
            __m512 w, c;
            block_side16(a, n, b, &w, &c);
            _mm512_storeu_ps(ds + b, _mm512_mul_ps(w, _mm512_loadu_ps(xd + b)));
            acc = _mm256_fmadd_ps(_mm512_castps512_ps256(c), _mm256_loadu_ps(xsf + b), acc);
            acc = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1)),
                                  _mm256_loadu_ps(xsf + b + 8), acc);
        }
        for (; b < nb; b += 8) {
            __mmask8 k = first_lanes(nb - b);
            __m256 w8, b8;
            k_side8(r, b, k, &w8, &b8);
            _mm256_storeu_ps(ds + b, _mm256_mul_ps(w8, _mm256_maskz_loadu_ps(k, xd + b)));
            acc = _mm256_fmadd_ps(b8, _mm256_maskz_loadu_ps(k, xsf + b), acc);
        }
        extra[0] = hsum8(acc) + bias;
        return;
    }
    row_factors_grouped(a, n, mm, xor_blocks, bias, xd, xsf, xs, ds, extra);
}

/* row_factors' general path (int4-k, groups of several blocks), a function of its own: its registers for up to
 * 15 rows made the Q4_1 path's calls (four a group of weight rows at decode) 1.1x slower where they shared a frame. */
static __attribute__((noinline)) void row_factors_grouped(const gemm_args *a, int n, int mm, int xor_blocks,
                                                          float bias, const float *xd, const float *xsf,
                                                          const int32_t *xs, float *ds, float *extra) {
    int nb = a->K / 32, stride = DSTRIDE(nb);
    int with_b = a->sub || deinterleaved(a->bits, a->lut), sgn = signed_codes(a);
    __m256 ev[TILE_FROM - 1], cv[TILE_FROM - 1]; /* mm < TILE_FROM (gemm1x's rows) */
    for (int m = 0; m < mm; m++) ev[m] = cv[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += 8) { /* each chunk's weight factors once for the rows, each row in its own lanes */
        __mmask8 k = first_lanes(nb - b), kx = first_lanes(xor_blocks - b);
        __m256 w8, b8;
        block_side8(a, n, b, &w8, &b8);
        for (int m = 0; m < mm; m++) {
            size_t at = (size_t)m * nb + b;
            __m256 d8 = _mm256_mul_ps(w8, _mm256_maskz_loadu_ps(k, xd + at));
            _mm256_storeu_ps(ds + (size_t)m * stride + b, d8);
            if (with_b) ev[m] = _mm256_fmadd_ps(b8, _mm256_maskz_loadu_ps(k, xsf + at), ev[m]);
            if (sgn) cv[m] = _mm256_fmadd_ps(d8, _mm256_cvtepi32_ps(_mm256_maskz_loadu_epi32(kx, xs + at)), cv[m]);
        }
    }
    for (int m = 0; m < mm; m++) extra[m] = (sgn ? -128.f * hsum8(cv[m]) : hsum8(ev[m])) + bias;
}

/* row_factors' extra for sixteen input rows at once, m0 .. m0 + 15, one a lane (xt's transposed copies; rows past
 * M and blocks past nb are zeros): each lane takes the fmas of its row alone in row_factors, in the same order, and
 * hsum8's sum of the eight lanes as adds of eight registers (add_round: builtins that gcc does not reassociate). A
 * tile's weight row: ws and wb its weight_side. */
static __m512 tile_extras(const gemm_args *a, const float *ws, const float *wb, int m0, float bias) {
    int nb = a->K / 32, mp = a->mp, with_b = a->sub || deinterleaved(a->bits, a->lut), sgn = signed_codes(a);
    const float *xdT = a->xt, *xsfT = xdT + (size_t)PAD16(nb) * mp, *xsT = xsfT + (size_t)PAD16(nb) * mp;
    __m512 e[8];
    for (int j = 0; j < 8; j++) e[j] = _mm512_setzero_ps();
    if (with_b) {
        for (int b0 = 0; b0 < nb; b0 += 8) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                size_t at = (size_t)(b0 + j) * mp + m0;
                e[j] = _mm512_fmadd_ps(_mm512_set1_ps(wb[b0 + j]), _mm512_loadu_ps(xsfT + at), e[j]);
            }
        }
    } else if (sgn) {
        for (int b0 = 0; b0 < nb; b0 += 8) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                size_t at = (size_t)(b0 + j) * mp + m0;
                __m512 d = _mm512_mul_round_ps(_mm512_set1_ps(ws[b0 + j]), _mm512_loadu_ps(xdT + at),
                                               _MM_FROUND_CUR_DIRECTION);
                e[j] = _mm512_fmadd_ps(d, _mm512_loadu_ps(xsT + at), e[j]);
            }
        }
    }
#define LPD_ADD(x, y) _mm512_add_round_ps(x, y, _MM_FROUND_CUR_DIRECTION)
    __m512 t = LPD_ADD(LPD_ADD(LPD_ADD(e[0], e[4]), LPD_ADD(e[2], e[6])),
                       LPD_ADD(LPD_ADD(e[1], e[5]), LPD_ADD(e[3], e[7])));
    if (sgn) t = _mm512_mul_round_ps(_mm512_set1_ps(-128.f), t, _MM_FROUND_CUR_DIRECTION);
    t = LPD_ADD(t, _mm512_set1_ps(bias));
#undef LPD_ADD
    return t;
}
#else
/* (Inlined: called from gemm16x too, gcc no longer inlined it into the one-row loop, whose products then took 1.1x
 * as long, a haswell build on the Zen 4.) */
static inline __attribute__((always_inline)) void row_factors(const gemm_args *a, int n, int m0, int mm,
                                                              int xor_blocks, float *ds, float *extra) {
    if (a->sc16) {
        q6k_factors(a, n, m0, mm, factor_count(a), ds, extra);
        return;
    }
    int nb = a->K / 32, ng = a->K / a->group, per_group = a->group / 32;
    if (a->sub) { /* int4-k: d x sc and dmin x mn, a super-block (8 groups) a register */
        k_row r = k_row_at(a->scales, a->biases, a->sub, n, nb);
        const uint8_t *sc = r.sc;
        const int8_t *mn = r.mn;
        const uint16_t *drow = r.d, *mrow = r.dmin;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
        /* the row's d and dmin in float, eight a conversion, once for every input row (where each super-block of
         * each input row converted its two alone) */
        int ns = (nb + 7) / 8, j = 0;
        float dv[ns], mv[ns];
        for (; j + 8 <= ns; j += 8) {
            _mm256_storeu_ps(dv + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + j))));
            _mm256_storeu_ps(mv + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mrow + j))));
        }
        for (; j < ns; j++) dv[j] = half_to_float(drow[j]), mv[j] = half_to_float(mrow[j]);
#endif
        for (int m = 0; m < mm; m++) {
            const float *xd = a->xd + (size_t)(m0 + m) * nb, *xsf = a->xsf + (size_t)(m0 + m) * nb;
            float *dm = ds + m * nb, e = 0.f;
            int b = 0;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
            __m256 ev = _mm256_setzero_ps();
            for (int sb = 0; b + 8 <= nb; b += 8, sb++) {
                __m128i sc8 = _mm_loadl_epi64((const __m128i *)(sc + b));
                __m128i mn8 = _mm_loadl_epi64((const __m128i *)(mn + b));
                __m256 w = _mm256_mul_ps(_mm256_set1_ps(dv[sb]), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
                __m256 c = _mm256_mul_ps(_mm256_set1_ps(mv[sb]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn8)));
                _mm256_storeu_ps(dm + b, _mm256_mul_ps(w, _mm256_loadu_ps(xd + b)));
                ev = _mm256_fmadd_ps(c, _mm256_loadu_ps(xsf + b), ev);
            }
            e = hsum8(ev);
#endif
            for (; b < nb; b++) {
                dm[b] = half_to_float(drow[b / 8]) * (float)sc[b] * xd[b];
                e = fmaf(half_to_float(mrow[b / 8]) * (float)mn[b], xsf[b], e);
            }
            extra[m] = e + (a->bias ? a->bias[n] : 0.f);
        }
        return;
    }
    const uint16_t *srow = a->scales + (size_t)n * ng;
    int with_b = deinterleaved(a->bits, a->lut); /* int4's biases, stored or symmetric */
    const uint16_t *brow = with_b && a->biases ? a->biases + (size_t)n * ng : NULL;
    const float sym = symmetric_bias(a->high);
    for (int m = 0; m < mm; m++) {
        const float *xd = a->xd + (size_t)(m0 + m) * nb, *xsf = a->xsf + (size_t)(m0 + m) * nb;
        float *dm = ds + m * nb, e = 0.f;
        int b = 0;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
        if (per_group == 1) {
            __m256 ev = _mm256_setzero_ps();
            for (; b + 8 <= nb; b += 8) {
                __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(srow + b)));
                _mm256_storeu_ps(dm + b, _mm256_mul_ps(w, _mm256_loadu_ps(xd + b)));
                if (with_b)
                    ev = _mm256_fmadd_ps(brow ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(brow + b)))
                                              : _mm256_mul_ps(w, _mm256_set1_ps(sym)),
                                         _mm256_loadu_ps(xsf + b), ev);
            }
            e = hsum8(ev);
        }
#endif
        for (; b < nb; b++) {
            float w = half_to_float(srow[b / per_group]);
            dm[b] = w * xd[b];
            if (with_b) e = fmaf(brow ? half_to_float(brow[b / per_group]) : sym * w, xsf[b], e);
        }
        if (signed_codes(a)) { /* AVX512's (w + 128) x, less 128 * sum(x): eight blocks a step, where one sum's chain
                             * of adds cost a K = 576 row some 70 cycles beside the 20 or so of its products */
            const int32_t *xs = a->xsum + (size_t)(m0 + m) * nb;
            float c = 0.f;
            b = 0;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
            __m256 cv = _mm256_setzero_ps();
            for (; b + 8 <= xor_blocks; b += 8)
                cv = _mm256_fmadd_ps(_mm256_loadu_ps(dm + b),
                                     _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + b))), cv);
            c = hsum8(cv);
#endif
            for (; b < xor_blocks; b++) c = fmaf(dm[b], (float)xs[b], c);
            e = -128.f * c; /* exact: what extra adds it to is the same with or without an fma */
        }
        extra[m] = e + (a->bias ? a->bias[n] : 0.f);
    }
}

#endif

#if defined(LPD_AVX512)
/* One input row (decode) against weight rows n, n + 4, ... while four fit below n1 (nb even; not Q6_K or Q3_K, whose
 * factors are a sub-block's: gemv1_sub16): row_factors and the products in one pass over the rows. Sixteen blocks at a time, the
 * four rows' factors (block_side16's, times the input's scales) stay in registers, each pair's two picked from the
 * sixteen by a constant permute, and each row's term (int4's biases, int4-k's minima times the blocks' sums; the
 * signed codes' factors times theirs) goes on in row_factors' eight-lane sums in its order, so that every row gets
 * the floats of row_factors and the tiles (gemm_tile) whatever rows share the step. Where row_factors first wrote
 * each row's factors and term to memory, a pass over the row of its own, and the old one-row loop (gemv4) read them
 * back two at a time, the one-row products of a
 * Q4_0 file took 1.5x the time (two layers of SmolLM2-1.7B's, the Zen 4). Returns the next row. */
static inline __attribute__((always_inline)) int gemv1_as(const gemm_args *a, wfmt f, int n, int n1) {
    int K = a->K, nb = K / 32;
    size_t row_bytes = f.b4 ? K / 2 : K;
    const size_t step = f.b4 ? 64 : 128; /* the four rows' bytes a block */
    const int biased = a->sub || deinterleaved(a->bits, a->lut);
    const __m512i tab = lut_table(a);
    const run_plan ahead = plan_run(4 * row_bytes, K, f);
    for (; n + 4 <= n1; n += 4) {
        const uint8_t *w[4] = {a->w + (size_t)n * row_bytes, a->w + (size_t)(n + 1) * row_bytes,
                               a->w + (size_t)(n + 2) * row_bytes, a->w + (size_t)(n + 3) * row_bytes};
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        __m256 ext[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < nb; c += 16) { /* sixteen blocks: the rows' factors and terms, then the eight pairs */
            __mmask16 k = first16(nb - c);
            __m512 ds[4], xd = _mm512_maskz_loadu_ps(k, a->xd + c);
            /* the input's side of the terms: the blocks' sums in float, or the signed codes' integer sums over the
             * blocks (all: nb even) */
            __m512 in = biased ? _mm512_maskz_loadu_ps(k, a->xsf + c)
                               : _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(k, a->xsum + c));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                __m512 ws, wb;
                block_side16(a, n + r, c, &ws, &wb);
                ds[r] = _mm512_mul_ps(ws, xd);
                __m512 side = biased ? wb : ds[r];
                ext[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(side), _mm512_castps512_ps256(in), ext[r]);
                ext[r] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(side), 1)),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(in), 1)), ext[r]);
            }
#pragma GCC unroll 8
            for (int j = 0; j < 16; j += 2) {
                int b = c + j;
                if (b >= nb) break;
                __m512i x = _mm512_loadu_si512(a->xq + b * 32), xl = _mm512_loadu_si512(a->xq + a->lo + b * 32);
                prefetch_group(a, f, ahead, w[0], b * step, 2 * step);
                const __m512i pick = _mm512_set_epi32(j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1,
                                                      j, j, j, j, j, j, j, j);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    __m512i p = hi_lo_sums(load_pair_as(a, f, w[r], b, tab), x, xl);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick, ds[r]), acc[r]);
                }
            }
        }
        for (int r = 0; r < 4; r++) { /* row_factors' extra, then the tiles' sum */
            float e = hsum8(ext[r]), bias = a->bias ? a->bias[n + r] : 0.f;
            a->y[n + r] = _mm512_reduce_add_ps(acc[r]) + ((biased ? e : -128.f * e) + bias);
        }
    }
    return n;
}
static __attribute__((noinline)) int gemv1(const gemm_args *a, int n, int n1) {
#define LPD_CALL(F) return gemv1_as(a, F, n, n1)
    LPD_DISPATCH_BY_BLOCK(fmt_of(a));
#undef LPD_CALL
}

/* gemv1 for a factor a sub-block of 16 (Q6_K, Q3_K; K a multiple of 256): a super-block (eight blocks, sixteen
 * sub-blocks) at a time, q6k_factors' sixteen factors of each of the four rows in a register and its term's fma in its
 * order, each pair's four factors then picked from the sixteen (pair_pick's lanes); q6k_factors' and the tiles' floats.
 * Where q6k_factors wrote them to memory first, a pass over each row of its own, the one-row Q6_K products of two
 * SmolLM2-1.7B layers took 1.2x the time (the Zen 4). Returns the next row. */
static inline __attribute__((always_inline)) int gemv1_sub16_as(const gemm_args *a, wfmt f, int n, int n1) {
    int K = a->K, nb = K / 32, ns = 2 * nb;
    const size_t step = 64; /* the four rows' bytes a block */
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i tab = lut_table(a);
    const float off = -term_times(a);
    const run_plan ahead = plan_run(4 * (size_t)(K / 2), K, f);
    for (; n + 4 <= n1; n += 4) {
        const uint8_t *w[4] = {a->w + (size_t)n * (K / 2), a->w + (size_t)(n + 1) * (K / 2),
                               a->w + (size_t)(n + 2) * (K / 2), a->w + (size_t)(n + 3) * (K / 2)};
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 ext[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int s = 0; s < ns; s += 16) { /* a super-block: the rows' factors and terms, then its four pairs */
            __m512 xd = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(a->xd + s / 2)));
            __m512 xs = _mm512_cvtepi32_ps(_mm512_loadu_si512(a->xs16 + s));
            __m512 fs[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                /* the rows' scales (and Q2_K's minima) eight super-blocks ahead: four rows of each are streams
                 * apart from the codes', which the processor's prefetchers left waiting (2048 x 8192 Q2_K products
                 * 1.08-1.11x as fast, Q6_K's 1.01-1.04x) */
                const size_t ahead16 = (size_t)(n + r) * ns + s + 128;
                _mm_prefetch((const char *)(a->sc16 + ahead16), _MM_HINT_T0);
                if (a->mn16) _mm_prefetch((const char *)(a->mn16 + ahead16), _MM_HINT_T0);
                fs[r] = _mm512_mul_ps(q6k_side16(a, n + r, s), xd);
                __m512 t = a->mn16 ? _mm512_mul_ps(q2k_min16(a, n + r, s), xd) : fs[r]; /* (term_times) */
                ext[r] = _mm512_fmadd_ps(t, xs, ext[r]);
            }
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                int b = s / 2 + j;
                __m512i x = _mm512_loadu_si512(a->xq + b * 32), xl = _mm512_loadu_si512(a->xq + a->lo + b * 32);
                prefetch_group(a, f, ahead, w[0], b * step, 2 * step);
                const int q = 2 * j; /* the pair's four factors: lanes q .. q + 3 of the sixteen */
                const __m512i pick = _mm512_set_epi32(q + 3, q + 3, q + 2, q + 2, q + 3, q + 3, q + 2, q + 2,
                                                      q + 1, q + 1, q, q, q + 1, q + 1, q, q);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    __m512i p = hi_lo_sums(load_pair_as(a, f, w[r], b, tab), x, xl);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick, fs[r]), acc[r]);
                }
            }
        }
        for (int r = 0; r < 4; r++) /* q6k_factors' extra, then the tiles' sum */
            a->y[n + r] = _mm512_reduce_add_ps(acc[r])
                          + (off * _mm512_reduce_add_ps(ext[r]) + (a->bias ? a->bias[n + r] : 0.f));
    }
    return n;
}
static __attribute__((noinline)) int gemv1_sub16(const gemm_args *a, int n, int n1) {
    if (a->top) return gemv1_sub16_as(a, (wfmt){0, 1, 0, 1, 1}, n, n1); /* Q6_K */
    return gemv1_sub16_as(a, (wfmt){0, 1, 0, 0, 1}, n, n1);           /* Q3_K, Q2_K */
}
#endif

#if defined(LPD_AVX512)
/* Weight rows n, n + 4, ... (while four fit below n1) against every input row (M >= TILE_FROM, nb even): each group
 * of four weight rows takes its factors (weight_side) and its terms for sixteen input rows at a time (tile_extras)
 * once, then 4 x 4 tiles (gemm4x) over the input rows, each tile's factors ws x xd sixteen blocks a multiply.
 * Where row_factors worked out each (weight row, input row)'s factors and terms, 16 to 64 rows cost 0.8x to 0.9x
 * (SmolLM2-135M's four products, Zen 4); each row's floats are row_factors' and gemv4's. Returns the next row. */
static int tile_rows(const gemm_args *a, int n, int n1) {
    int nb = a->K / 32, np = PAD16(nb), mp = a->mp;
    float *side = a->side, *ext = side + 8 * np, *dt = ext + 4 * mp; /* 4 x (ws, wb), 4 x mp terms, 16 x np ds */
    for (; n + 4 <= n1; n += 4) {
        for (int r = 0; r < 4; r++) {
            float *ws = side + 2 * r * np, *wb = ws + np, bias = a->bias ? a->bias[n + r] : 0.f;
            weight_side(a, n + r, ws, wb);
            for (int m0 = 0; m0 < a->M; m0 += 16) _mm512_storeu_ps(ext + r * mp + m0, tile_extras(a, ws, wb, m0, bias));
        }
        for (int m0 = 0; m0 < a->M; m0 += ROWS_AT_ONCE) {
            int mm = a->M - m0 < ROWS_AT_ONCE ? a->M - m0 : ROWS_AT_ONCE;
            float extra[4 * ROWS_AT_ONCE];
            for (int r = 0; r < 4; r++) {
                const float *ws = side + 2 * r * np;
                for (int m = 0; m < mm; m++) {
                    const float *xd = a->xd + (size_t)(m0 + m) * nb;
                    float *d = dt + (size_t)(r * ROWS_AT_ONCE + m) * np;
                    for (int b = 0; b < nb; b += 16) {
                        __mmask16 k = nb - b >= 16 ? 0xffff : (1u << (nb - b)) - 1;
                        _mm512_storeu_ps(d + b, _mm512_mul_ps(_mm512_loadu_ps(ws + b), _mm512_maskz_loadu_ps(k, xd + b)));
                    }
                    extra[r * ROWS_AT_ONCE + m] = ext[r * mp + m0 + m];
                }
            }
            gemm4x(a, n, m0, mm, dt, np, extra);
        }
    }
    return n;
}
#endif

/* Weight rows n0 .. n1 - 1 against every input row. ds: the thread's scratch (gemm_task). */
static void gemm_rows(const gemm_args *a, int n0, int n1, float *ds) {
    int K = a->K, nb = K / 32, N = a->N;
    size_t row_bytes = a->bits == 4 ? K / 2 : K;
    int fc = factor_count(a);
    int32_t *sums = (int32_t *)(ds + 4 * ROWS_AT_ONCE * DSTRIDE(fc)); /* after 16 rows of factors (gemm1x's, gemm4x's) */
#if defined(LPD_AVX512)
    int vec_blocks = nb & ~1, xor_blocks = vec_blocks; /* two at a time; an odd last one goes alone */
#elif defined(LPD_AVX2)
    int vec_blocks = nb, xor_blocks = 0;
#else
    int vec_blocks = 0, xor_blocks = 0;
#endif
    int n = n0;
#if defined(LPD_AVX512)
    if (a->M == 1 && vec_blocks == nb && !a->sc16) n = gemv1(a, n, n1);
    if (a->M == 1 && a->sc16 && a->K % 256 == 0 && !a->lut && !a->high && a->bits == 4) n = gemv1_sub16(a, n, n1);
#endif
#if defined(LPD_AVX2)
    if (a->M == 1 && vec_blocks == nb) {
        for (; n + 4 <= n1; n += 4) {
            float extra[4];
            prefetch_factors(a, n + FACTOR_AHEAD, 4);
            for (int r = 0; r < 4; r++) row_factors(a, n + r, 0, 1, xor_blocks, ds + r * DSTRIDE(fc), extra + r);
            gemv4(a, n, ds, extra);
        }
    }
#endif
#if defined(LPD_AVX512)
    if (a->M >= TILE_FROM && vec_blocks == nb && !a->sc16) n = tile_rows(a, n, n1); /* (Q6_K: gemm1x4's) */
    if (a->M > 1 && a->M < TILE_FROM && a->xw) { /* 2 to 15 rows: each weight row against all at once */
        gemm1x(a, n, n1, xor_blocks, ds);
        n = n1;
    }
#elif defined(LPD_AVX2)
    if (a->M > 1 && a->M < TILE_FROM) {
        gemm16x(a, n, n1, xor_blocks, ds);
        n = n1;
    }
#endif
    for (; n < n1; n++) {
        const uint8_t *wrow = a->w + (size_t)n * row_bytes;
        for (int m0 = 0; m0 < a->M; m0 += ROWS_AT_ONCE) {
            int mm = a->M - m0 < ROWS_AT_ONCE ? a->M - m0 : ROWS_AT_ONCE;
            float extra[ROWS_AT_ONCE];
            row_factors(a, n, m0, mm, xor_blocks, ds, extra);
#if defined(LPD_AVX512)
            if (vec_blocks == nb) {
                gemm1x4(a, n, m0, mm, ds, extra);
                continue;
            }
#endif
            float y[ROWS_AT_ONCE] = {0};
#if defined(LPD_AVX512)
            __m512 acc[ROWS_AT_ONCE];
            for (int m = 0; m < mm; m++) acc[m] = _mm512_setzero_ps();
            const __m512i tab = lut_table(a);
            for (int b = 0; b < vec_blocks; b += 2) {
                __m512i wv = load_pair(a, wrow, b, tab);
                for (int m = 0; m < mm; m++) {
                    const int8_t *x = a->xq + (size_t)(m0 + m) * K + b * 32;
                    __m512i p = hi_lo_sums(wv, _mm512_loadu_si512(x), _mm512_loadu_si512(x + a->lo));
                    __m512 f = _mm512_insertf32x8(_mm512_set1_ps(ds[m * DSTRIDE(nb) + b]), _mm256_set1_ps(ds[m * DSTRIDE(nb) + b + 1]), 1);
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[m]);
                }
            }
            for (int m = 0; m < mm; m++) y[m] = _mm512_reduce_add_ps(acc[m]);
#elif defined(LPD_AVX2)
            __m256 acc[ROWS_AT_ONCE];
            for (int m = 0; m < mm; m++) acc[m] = _mm256_setzero_ps();
            const __m128i tab = lut_table(a);
            for (int b = 0; b < vec_blocks; b++) {
                for (int m = 0; m < mm; m++) {
                    const int16_t *x = a->x16 + (size_t)(m0 + m) * K + b * 32;
                    __m256i p = dot16(a, wrow, b, _mm256_loadu_si256((const __m256i *)x),
                                      _mm256_loadu_si256((const __m256i *)(x + 16)), tab);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), block_factor(a, ds + m * fc, b), acc[m]);
                }
            }
            for (int m = 0; m < mm; m++) y[m] = hsum8(acc[m]);
#endif
            if (vec_blocks < nb) { /* what the vector loop left: every block in plain C, AVX512's odd last one */
                gemm_args rest = *a;
                rest.K = K - vec_blocks * 32;
                for (int m = 0; m < mm; m++) {
                    const int8_t *x = a->xq + (size_t)(m0 + m) * K + vec_blocks * 32;
                    block_sums(&rest, wrow + (a->bits == 4 ? vec_blocks * 16 : vec_blocks * 32), x, 1, sums);
                    const float *dm = ds + m * DSTRIDE(fc);
                    for (int b = vec_blocks; b < nb; b++) {
                        if (a->sc16) /* (vec_blocks 0: a build without SIMD) */
                            y[m] += dm[2 * b] * (float)sums[2 * (b - vec_blocks)]
                                    + dm[2 * b + 1] * (float)sums[2 * (b - vec_blocks) + 1];
                        else
                            y[m] += dm[b] * (float)sums[b - vec_blocks];
                    }
                }
            }
            for (int m = 0; m < mm; m++) a->y[(size_t)(m0 + m) * N + n] = y[m] + extra[m];
        }
    }
}

/* Input block i's two sub-block integer sums (each value 256 hi + lo): block positions 0 .. 7 and 16 .. 23 (columns
 * 0 .. 15), then the rest (the input is deinterleaved as the nibbles are). */
static inline void sub16_sums(const gemm_args *a, size_t i, int32_t *out) {
    const int8_t *h = a->xq + 32 * i, *l = h + a->lo;
    int32_t s0 = 0, s1 = 0;
    for (int j = 0; j < 8; j++) {
        s0 += 256 * (h[j] + h[16 + j]) + l[j] + l[16 + j];
        s1 += 256 * (h[8 + j] + h[24 + j]) + l[8 + j] + l[24 + j];
    }
    out[0] = s0, out[1] = s1;
}

static void gemm_task(void *ctx, int ith, int nth) {
    const gemm_args *a = ctx;
    int K = a->K, nb = K / 32;
    static __thread void *buf;
    static __thread size_t cap;
    int fc = factor_count(a);
    size_t factors = (sizeof(float) * (4 * ROWS_AT_ONCE * DSTRIDE(fc) + ROWS_AT_ONCE * fc + (size_t)a->M * nb
                                       + (a->sc16 ? (size_t)a->M * fc : 0)) + 63) / 64 * 64; /* ds, sums, xsf, xs16 */
#if defined(LPD_AVX2)
    size_t wide = sizeof(int16_t) * (size_t)a->M * K;
#elif defined(LPD_AVX512)
    int mp = (a->M + 15) & ~15, np = PAD16(nb);
    size_t wide = sizeof(float) * (24 * (size_t)np + 4 * (size_t)mp + (a->M >= TILE_FROM ? 3 * (size_t)np * mp : 0))
                  + (a->M > 1 ? sizeof(int16_t) * (size_t)a->M * K : 0);
#else
    size_t wide = 0;
#endif
    float *ds = scratch(&buf, &cap, factors + wide + 64);
    if (!ds) return;
    gemm_args own = *a;
    float *xsf = ds + 4 * ROWS_AT_ONCE * DSTRIDE(fc) + ROWS_AT_ONCE * fc;
    for (size_t i = 0; i < (size_t)a->M * nb; i++) xsf[i] = a->xd[i] * (float)a->xsum[i];
    own.xsf = xsf;
    if (a->sc16) { /* each sub-block's integer input sum */
        int32_t *xs16 = (int32_t *)(xsf + (size_t)a->M * nb);
        for (size_t i = 0; i < (size_t)a->M * nb; i++) sub16_sums(a, i, xs16 + 2 * i);
        own.xs16 = xs16;
    }
#if defined(LPD_AVX512)
    own.side = (float *)((char *)ds + factors);
    own.mp = mp;
    if (a->M >= TILE_FROM) { /* xd, xsf and the sums as floats, block by block, a row a lane (tile_extras) */
        float *xt = own.side + 24 * np + 4 * mp;
        size_t plane = (size_t)np * mp;
        memset(xt, 0, sizeof(float) * 3 * plane);
        for (int m = 0; m < a->M; m++)
            for (int b = 0; b < nb; b++) {
                size_t i = (size_t)m * nb + b, at = (size_t)b * mp + m;
                xt[at] = a->xd[i];
                xt[plane + at] = xsf[i];
                xt[2 * plane + at] = (float)a->xsum[i];
            }
        own.xt = xt;
    }
    if (a->M > 1 && !(nb & 1)) { /* each value whole, for gemm_tile */
        int16_t *xw = (int16_t *)(own.side + 24 * np + 4 * mp + (a->M >= TILE_FROM ? 3 * (size_t)np * mp : 0));
        for (int m = 0; m < a->M; m++) widen_row(a->xq + (size_t)m * K, a->xq + a->lo + (size_t)m * K, K, xw + (size_t)m * K);
        own.xw = xw;
    }
#endif
#if defined(LPD_AVX2)
    int16_t *x16 = (int16_t *)((char *)ds + factors);
    for (size_t i = 0; i < (size_t)a->M * K; i++) x16[i] = (int16_t)(256 * a->xq[i] + a->xq[a->lo + i]);
    own.x16 = x16;
#endif
    int n0, n1;
    share(a->N, ith, nth, &n0, &n1);
    gemm_rows(&own, n0, n1, ds);
}

typedef struct {
    int pre, M, K, deint;
    const float *x, *residual, *norm_w;
    float eps;
    float *sum_out;
    int8_t *xq;
    float *xd;
    int32_t *xsum;
} input_args;

static void input_task(void *ctx, int ith, int nth) { /* each thread its share of every row's blocks */
    const input_args *a = ctx;
    int b0, b1, K = a->K, nb = K / 32, xw = a->pre >= PRE_SILU ? 2 * K : K;
    share(nb, ith, nth, &b0, &b1);
    if (b0 == b1) return;
    static __thread void *buf;
    static __thread size_t cap;
    float *h = scratch(&buf, &cap, sizeof(float) * K);
    if (!h) return;
    for (int m = 0; m < a->M; m++) {
        const float *x = a->x + (size_t)m * xw, *res = a->residual ? a->residual + (size_t)m * K : NULL;
        float r = a->pre == PRE_NORM ? norm_factor(x, res, K, a->eps) : 0.f;
        input_cols(a->pre, x, res, a->norm_w, r, a->sum_out ? a->sum_out + (size_t)m * K : NULL, K, b0 * 32, b1 * 32,
                   h);
        quantize_blocks(h, b0, b1, a->deint, a->xq + (size_t)m * K, a->xq + (size_t)a->M * K + (size_t)m * K,
                        a->xd + (size_t)m * nb, a->xsum + (size_t)m * nb);
    }
}

/* y [M, N] = input step of x, then @ W.T (+ bias). bits 4: w = packed int4 [N, K/2] with scales and biases [N,
 * K/group] float16 (int4-k: sub set; a codebook's: lut set, biases NULL; a 5-bit weight's: high set, group 32; Q6_K:
 * top its codes' two upper bits (upper_group), scales its d, sc16 its sub-blocks' int8 scales, biases NULL); bits 8:
 * w = int8 [N, K] with scales [N, K/group], biases NULL. pre: PRE_NONE (x [M, K]),
 * PRE_NORM (x, residual or NULL, norm_w [K], eps; x + residual stored in sum_out [M, K], apart from both), or an
 * activation (x =
 * [gate | up], [M, 2K]). K a multiple of 32, group a multiple of 32 dividing K. Returns 0, or -1 without memory. */
/* lpd_linear's and lpd_prefill_gemm's first step: x's M rows through the input step and rounded (input_task) into
 * the thread's scratch, *in describing them, `extra` bytes after them for the caller; returns those, NULL without
 * memory. */
static char *round_rows(input_args *in, int pre, const float *x, const float *residual, const float *norm_w,
                        float eps, float *sum_out, int M, int K, int deint, int nth, size_t extra) {
    static __thread void *buf;
    static __thread size_t cap;
    int nb = K / 32;
    size_t q_bytes = (2 * (size_t)M * K + 63) / 64 * 64, d_bytes = ((size_t)M * nb * 4 + 63) / 64 * 64;
    char *mem = scratch(&buf, &cap, q_bytes + 2 * d_bytes + extra);
    if (!mem) return NULL;
    *in = (input_args){pre, M, K, deint, x, residual, norm_w, eps, sum_out, (int8_t *)mem, (float *)(mem + q_bytes),
                       (int32_t *)(mem + q_bytes + d_bytes)};
    parallel(input_task, in, M >= 8 ? nth : 1);
    return mem + q_bytes + 2 * d_bytes;
}

int lpd_linear(int pre, const float *x, const float *residual, const float *norm_w, float eps, float *sum_out, int M,
               int K, int bits, const void *w, const uint16_t *scales, const uint16_t *biases, const uint8_t *sub,
               const int8_t *lut, const uint8_t *high, const uint8_t *top, const int8_t *sc16, const int8_t *mn16,
               int group, int N, const float *bias, float *y, int nth) {
    input_args in;
    if (!round_rows(&in, pre, x, residual, norm_w, eps, sum_out, M, K, deinterleaved(bits, lut), nth, 0)) return -1;
    gemm_args g = {M, N, K, group, bits, in.xq, (size_t)M * K, in.xd, in.xsum, NULL, NULL, w, scales, biases,
                   sub, lut, bias, y};
    g.high = high, g.top = top, g.sc16 = sc16, g.mn16 = mn16;
    parallel(gemm_task, &g, nth);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * Prefill's products on AVX512-VNNI: the same rounded rows as lpd_linear's (input_task: each value 256 hi + lo
 * at its block's scale), multiplied as whole int16 values against the weight's codes widened to int16, with
 * vpdpwssd: sixteen input rows in the lanes and one weight row's pair of values broadcast, so each instruction
 * makes 32 exact products, twice float32's FMAs a cycle (a float GEMM over the dequantized weight reached 61% of
 * those, docs/PERF.md). Each block's integer sums become floats once a block: (weight scale x input scale) x sum,
 * plus, for weights with a bias a block (int4's, int4-k's), that bias x the input block's sum. Symmetric weights go
 * in with their offset taken off the codes (no term), Q6_K's and Q3_K's with their sub-block scales multiplied in
 * (one factor a block: d). A lane's sum stays below 2^31: |256 hi + lo| <= 32639, and 32 products of it with values
 * up to 2^11 (Q3_K's 8 x 128, int8's 128) fit, 16 with Q6_K's 32 x 128 (pf_cols_as). On the 2-core Zen 4 a 1.7B
 * model's products ran at 300-330 GFLOP/s where the float32 GEMM ran 120-160 (docs/PERF.md). The rows' floats are
 * not lpd_linear's (another order of the same exact block sums). */
#if defined(LPD_AVX512)
#define PF_COLS 6 /* weight rows a tile: 2 x 16 input rows x 6 weight rows of sums in registers */
typedef struct {
    const gemm_args *g;
    int mp;            /* M rounded up to 16 */
    const int32_t *xT; /* [mp / 16][K / 2][16]: each pair of input values (int16, the weight's column order) */
    const float *xdT, *xsfT; /* [mp / 16][nb][16]: each block's scale, and its scale x its integer sum */
    int asym;                /* the weight has a bias a block (stored int4 biases, int4-k's dmin x mn) */
} pf_args;

/* Rows of 16 at a time: thread ith's share of the pairs, transposed (rows padded with zeros up to mp). */
static void pf_input_task(void *ctx, int ith, int nth) {
    const pf_args *p = ctx;
    const gemm_args *a = p->g;
    int K = a->K, nb = K / 32, g0, g1;
    share(p->mp / 16, ith, nth, &g0, &g1);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int g = g0; g < g1; g++) {
        int32_t *out = (int32_t *)p->xT + (size_t)g * 16 * (K / 2);
        float *xd = (float *)p->xdT + (size_t)g * 16 * nb, *xsf = (float *)p->xsfT + (size_t)g * 16 * nb;
        for (int l = 0; l < 16; l++) {
            int m = 16 * g + l;
            if (m >= a->M) {
                for (int q = 0; q < K / 2; q++) out[(size_t)q * 16 + l] = 0;
                for (int b = 0; b < nb; b++) xd[b * 16 + l] = xsf[b * 16 + l] = 0.f;
                continue;
            }
            const int8_t *hi = a->xq + (size_t)m * K, *lo = hi + a->lo;
            for (int k = 0; k < K; k += 32) /* 32 values: 16 pairs, pair q to out[q][l] */
                _mm512_i32scatter_epi32(out + (size_t)(k / 2) * 16 + l, idx, whole32(hi + k, lo + k), 4);
            for (int b = 0; b < nb; b++) {
                xd[b * 16 + l] = a->xd[(size_t)m * nb + b];
                xsf[b * 16 + l] = a->xd[(size_t)m * nb + b] * (float)a->xsum[(size_t)m * nb + b];
            }
        }
    }
}

/* Weight rows n .. n + cols - 1 (cols <= PF_COLS; the rest zeros) as int16 values in wr [PF_COLS][K], in the
 * input's column order, and their factors ws (and biases wb) [nb][PF_COLS]. */
static inline __attribute__((always_inline)) void pf_pack_as(const pf_args *p, wfmt f, int n, int cols, int16_t *wr,
                                                             float *ws, float *wb) {
    const gemm_args *a = p->g;
    int K = a->K, nb = K / 32;
    size_t row_bytes = a->bits == 4 ? K / 2 : K;
    const __m512i tab = lut_table(a);
    /* what comes off a code: a symmetric weight's offset (int8's and codebooks' flip), none where a bias says */
    int off = f.sc16 ? sub16_offset(a->high, a->top, a->mn16) : p->asym ? 0 : signed_codes(a) ? 128
                                                                       : (int)-symmetric_bias(a->high);
    const __m512i voff = _mm512_set1_epi16((short)off);
    for (int j = 0; j < PF_COLS; j++) {
        int16_t *o = wr + (size_t)j * K;
        if (j >= cols) {
            memset(o, 0, sizeof(int16_t) * K);
            for (int b = 0; b < nb; b++) ws[b * PF_COLS + j] = wb[b * PF_COLS + j] = 0.f;
            continue;
        }
        const uint8_t *wrow = a->w + (size_t)(n + j) * row_bytes;
        for (int b = 0; b < nb; b += 2) {
            __m512i v = load_pair_as(a, f, wrow, b, tab);
            __m512i v0 = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v)), voff);
            __m512i v1 = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1)), voff);
            if (f.sc16) { /* block b's sub-blocks: positions 0 .. 7, 16 .. 23 (columns 0 .. 15), then the rest */
                uint32_t s4;
                memcpy(&s4, a->sc16 + (size_t)(n + j) * (K / 16) + 2 * b, 4);
                __m512i sc = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_cvtsi32_si128((int)s4)));
                const __m512i pick0 = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                                       1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
                v0 = _mm512_mullo_epi16(v0, _mm512_permutexvar_epi16(pick0, sc));
                const __m512i pick1 = _mm512_add_epi16(pick0, _mm512_set1_epi16(2)); /* block b + 1's */
                v1 = _mm512_mullo_epi16(v1, _mm512_permutexvar_epi16(pick1, sc));
            }
            _mm512_storeu_si512(o + b * 32, v0);
            _mm512_storeu_si512(o + b * 32 + 32, v1);
        }
        if (f.sc16) {
            for (int b = 0; b < nb; b++) {
                ws[b * PF_COLS + j] = half_to_float(a->scales[(size_t)(n + j) * (K / 256) + b / 8]);
                wb[b * PF_COLS + j] = 0.f;
            }
            continue;
        }
        for (int c = 0; c < nb; c += 16) {
            __m512 s, t;
            float s16[16], t16[16];
            block_side16(a, n + j, c, &s, &t);
            _mm512_storeu_ps(s16, s);
            _mm512_storeu_ps(t16, t);
            for (int i = 0; i < 16 && c + i < nb; i++) {
                ws[(c + i) * PF_COLS + j] = s16[i];
                wb[(c + i) * PF_COLS + j] = p->asym ? t16[i] : 0.f;
            }
        }
    }
}

/* The offsets of sixteen rows of an output y [M, N], 0, N, .. 15 N: one column's sixteen input rows, scattered. */
static inline __m512i row_offsets16(int N) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(N));
}

/* Input rows m0 .. m0 + 16 MR - 1 against the packed weight rows n .. n + PF_COLS - 1 (those below N stored): the
 * sums of a block in registers, the floats in acc (the thread's, in L1: a load and a store a block). */
static inline __attribute__((always_inline)) void pf_tile(const pf_args *p, const int16_t *wr, const float *ws,
                                                          const float *wb, float *acc, int n, int m0, const int MR,
                                                          const int ASYM, const int HALVES) {
    const gemm_args *a = p->g;
    int K = a->K, nb = K / 32;
    const int32_t *x[2];
    const float *xd[2], *xsf[2];
    for (int i = 0; i < MR; i++) {
        x[i] = p->xT + (size_t)(m0 / 16 + i) * 16 * (K / 2);
        xd[i] = p->xdT + (size_t)(m0 / 16 + i) * 16 * nb;
        xsf[i] = p->xsfT + (size_t)(m0 / 16 + i) * 16 * nb;
    }
    memset(acc, 0, sizeof(float) * 16 * MR * PF_COLS);
    for (int b = 0; b < nb; b++) {
        const int16_t *wq = wr + 32 * b;
        const int32_t *x0 = x[0] + (size_t)b * 256, *x1 = x[MR - 1] + (size_t)b * 256;
        for (int h = 0; h < HALVES; h++) { /* each lane's sum of 32 / HALVES products */
            __m512i s[2][PF_COLS];
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < PF_COLS; j++) s[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int q = h * 16 / HALVES; q < (h + 1) * 16 / HALVES; q++) {
                __m512i xv[2] = {_mm512_loadu_si512(x0 + 16 * q), _mm512_loadu_si512(x1 + 16 * q)};
                for (int j = 0; j < PF_COLS; j++) {
                    int32_t wpair;
                    memcpy(&wpair, wq + (size_t)j * K + 2 * q, 4);
                    __m512i wv = _mm512_set1_epi32(wpair);
                    for (int i = 0; i < MR; i++) s[i][j] = _mm512_dpwssd_epi32(s[i][j], xv[i], wv);
                }
            }
            for (int i = 0; i < MR; i++) {
                __m512 d = _mm512_loadu_ps(xd[i] + 16 * b), e = ASYM ? _mm512_loadu_ps(xsf[i] + 16 * b) : d;
                for (int j = 0; j < PF_COLS; j++) {
                    float *o = acc + (i * PF_COLS + j) * 16;
                    __m512 f = _mm512_mul_ps(d, _mm512_set1_ps(ws[b * PF_COLS + j]));
                    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][j]), f, _mm512_load_ps(o));
                    if (ASYM) v = _mm512_fmadd_ps(e, _mm512_set1_ps(wb[b * PF_COLS + j]), v);
                    _mm512_store_ps(o, v);
                }
            }
        }
    }
    const __m512i rows = row_offsets16(a->N);
    for (int i = 0; i < MR; i++) {
        __mmask16 k = first16(a->M - (m0 + 16 * i));
        for (int j = 0; j < PF_COLS && n + j < a->N; j++) {
            __m512 v = _mm512_load_ps(acc + (i * PF_COLS + j) * 16);
            if (a->bias) v = _mm512_add_ps(v, _mm512_set1_ps(a->bias[n + j]));
            _mm512_mask_i32scatter_ps(a->y + (size_t)(m0 + 16 * i) * a->N + n + j, k, rows, v, 4);
        }
    }
}

static inline __attribute__((always_inline)) void pf_cols_as(const pf_args *p, wfmt f, int g0, int g1, int16_t *wr,
                                                             float *ws, float *wb, float *acc) {
    const gemm_args *a = p->g;
    for (int g = g0; g < g1; g++) {
        int n = g * PF_COLS, cols = a->N - n < PF_COLS ? a->N - n : PF_COLS;
        pf_pack_as(p, f, n, cols, wr, ws, wb);
        int m0 = 0; /* 32 input rows a tile, then 16 (rows past M zeros) */
#define LPD_TILES(ASYM, HALVES)                                                                                    \
    for (; m0 + 32 <= p->mp; m0 += 32) pf_tile(p, wr, ws, wb, acc, n, m0, 2, ASYM, HALVES);                        \
    if (m0 < p->mp) pf_tile(p, wr, ws, wb, acc, n, m0, 1, ASYM, HALVES);
        if (f.top) { /* Q6_K: |sc x (q - 32)| <= 4096, so a lane sums 16 products (< 2^31) before its floats */
            LPD_TILES(0, 2)
        } else if (p->asym) {
            LPD_TILES(1, 1)
        } else {
            LPD_TILES(0, 1)
        }
#undef LPD_TILES
    }
}

static void pf_task(void *ctx, int ith, int nth) {
    const pf_args *p = ctx;
    const gemm_args *a = p->g;
    int nb = a->K / 32, g0, g1;
    share((a->N + PF_COLS - 1) / PF_COLS, ith, nth, &g0, &g1);
    if (g0 == g1) return;
    static __thread void *buf;
    static __thread size_t cap;
    float *acc = scratch(&buf, &cap, sizeof(float) * 32 * PF_COLS + sizeof(int16_t) * PF_COLS * (size_t)a->K
                                         + 2 * sizeof(float) * PF_COLS * (size_t)nb + 64);
    if (!acc) return; /* (lpd_prefill_gemm's caller sees no failure: the scratch is small, taken before) */
    int16_t *wr = (int16_t *)(acc + 32 * PF_COLS);
    float *ws = (float *)(wr + PF_COLS * (size_t)a->K), *wb = ws + PF_COLS * (size_t)nb;
#define LPD_CALL(F) pf_cols_as(p, F, g0, g1, wr, ws, wb, acc)
    LPD_DISPATCH(fmt_of(a));
#undef LPD_CALL
}
#endif

#if defined(LPD_AVX512)
/* Q2_K (mn16 set) in prefill's products: pf_task multiplies its d x sc x q (sub16_offset 0, no term a block); these
 * take each output's minima term off, y[m, n] -= the sum over sub-blocks s of (dmin x mn) x the input's sub-block
 * sum (its block's scale x its integer sum, gemm_task's xs16). x16 [K / 16][mp]: those sums by sub-block, sixteen
 * input rows in a register (no sum across lanes), the rows past M zeros. */
typedef struct {
    const gemm_args *g;
    int mp;
    float *x16;
} pf_minima_args;
static void pf_minima_input_task(void *ctx, int ith, int nth) {
    const pf_minima_args *p = ctx;
    const gemm_args *a = p->g;
    int nb = a->K / 32, m0, m1;
    share(p->mp, ith, nth, &m0, &m1);
    for (int m = m0; m < m1; m++)
        for (int b = 0; b < nb; b++) {
            int32_t s[2] = {0, 0};
            float d = 0.f;
            if (m < a->M) {
                sub16_sums(a, (size_t)m * nb + b, s);
                d = a->xd[(size_t)m * nb + b];
            }
            p->x16[(size_t)(2 * b) * p->mp + m] = d * (float)s[0];
            p->x16[(size_t)(2 * b + 1) * p->mp + m] = d * (float)s[1];
        }
}
static void pf_minima_task(void *ctx, int ith, int nth) {
    const pf_minima_args *p = ctx;
    const gemm_args *a = p->g;
    int ns = a->K / 16, n0, n1;
    share(a->N, ith, nth, &n0, &n1);
    float mins[ns];
    const __m512i rows = row_offsets16(a->N);
    for (int n = n0; n < n1; n++) {
        for (int s = 0; s < ns; s += 16) _mm512_storeu_ps(mins + s, q2k_min16(a, n, s));
        for (int m = 0; m < p->mp; m += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int s = 0; s < ns; s++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(mins[s]), _mm512_loadu_ps(p->x16 + (size_t)s * p->mp + m), acc);
            __mmask16 k = first16(a->M - m);
            float *y = a->y + (size_t)m * a->N + n;
            _mm512_mask_i32scatter_ps(y, k, rows, _mm512_sub_ps(_mm512_mask_i32gather_ps(acc, k, rows, y, 4), acc), 4);
        }
    }
}
#endif

/* lpd_linear's y for many rows (prefill): its input step and rounding, the same rows, then pf_task's products
 * (Q2_K's: then its minima, pf_minima_task). Returns 0, -1 without memory, -3 where it does not take the product (not
 * an AVX512-VNNI build, or an odd number of blocks a row): lpd_dequant_gemm's float GEMMs then multiply. */
int lpd_prefill_gemm(int pre, const float *x, const float *residual, const float *norm_w, float eps, float *sum_out,
                     int M, int K, int bits, const void *w, const uint16_t *scales, const uint16_t *biases,
                     const uint8_t *sub, const int8_t *lut, const uint8_t *high, const uint8_t *top, const int8_t *sc16,
                     const int8_t *mn16, int group, int N, const float *bias, float *y, int nth) {
#if defined(LPD_AVX512)
    int nb = K / 32, mp = (M + 15) & ~15;
    if (nb & 1 || M < 1) return -3;
    size_t t_bytes = (2 * (size_t)mp * K + 63) / 64 * 64, td_bytes = (4 * (size_t)mp * nb + 63) / 64 * 64;
    size_t x16_bytes = mn16 ? sizeof(float) * (size_t)mp * (K / 16) : 0;
    input_args in;
    char *t = round_rows(&in, pre, x, residual, norm_w, eps, sum_out, M, K, deinterleaved(bits, lut), nth,
                         t_bytes + 2 * td_bytes + x16_bytes);
    if (!t) return -1;
    gemm_args g = {M, N, K, group, bits, in.xq, (size_t)M * K, in.xd, in.xsum, NULL, NULL, w, scales, biases,
                   sub, lut, bias, y};
    g.high = high, g.top = top, g.sc16 = sc16, g.mn16 = mn16;
    pf_args p = {&g, mp, (const int32_t *)t, (const float *)(t + t_bytes), (const float *)(t + t_bytes + td_bytes),
                 deinterleaved(bits, lut) && !sc16 && (biases || sub)};
    parallel(pf_input_task, &p, nth);
    parallel(pf_task, &p, nth);
    if (mn16) {
        pf_minima_args pm = {&g, mp, (float *)(t + t_bytes + 2 * td_bytes)};
        parallel(pf_minima_input_task, &pm, nth);
        parallel(pf_minima_task, &pm, nth);
    }
    return 0;
#else
    (void)pre, (void)x, (void)residual, (void)norm_w, (void)eps, (void)sum_out, (void)M, (void)K, (void)bits, (void)w;
    (void)scales, (void)biases, (void)sub, (void)lut, (void)high, (void)top, (void)sc16, (void)mn16, (void)group;
    (void)N, (void)bias, (void)y, (void)nth;
    return -3;
#endif
}

/* ------------------------------------------------------------------------------------------------------------
 * Paged attention over float or float16 pages [n_pages, PS, H, D]. Query rows of sequence b: q_starts[b] .. q_starts[b + 1];
 * its keys: positions 0 .. seq_lens[b] - 1 at page page_table[b, pos / PS]; its rows are the last positions. */
typedef struct {
    const float *q;
    long q_t, q_h;
    int T, Hq, D, H, PS, B, window;
    const kv_side *k, *v; /* the keys' and the values' pages */
    const int32_t *page_table, *seq_lens, *q_starts;
    long pt_stride;
    float scale;
    float *out;
    int *row_seq; /* each row's sequence */
    const int *group_row; /* [groups + 1]: each group's first row (row_groups) */
    int groups;
    int per;      /* query heads of one key head a task takes: each key and value row read once for them */
    int splits;   /* parts a row's positions are cut into, each a task (attention_shape) */
    float *part;  /* splits > 1: each (row, query head, part)'s max score, sum of exponentials and D unscaled
                   * outputs, [T, Hq, splits, D + 2], which merge_task joins */
    atomic_int *next; /* where given (zero at the start), threads take a task at a time from it */
    const int64_t *stage_slots; /* the rows' stage slots where a side is int4ch (else NULL): see own_page */
} attn_args;

/* q . k over a head: four independent sums, where one sum's chain of adds set the pace */
static inline float dot_head(const float *q, const float *k, int D) {
#if defined(LPD_AVX2) || defined(LPD_AVX512)
    if (D % 32 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), _mm256_loadu_ps(k + d + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), _mm256_loadu_ps(k + d + 24), s3);
        }
        return hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    }
#endif
    float s = 0.f;
    for (int d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

#define PREFETCH 32 /* rows ahead (load_chunk: 1.5x the rate of 4 over a 1.7B model's float16 pages at 1024) */
#define MAX_GROUP 8 /* query heads a task takes at most */

/* Where position p's row starts (in floats from the pool's start, rows of `tok` floats), and in *run how many rows
 * from it on lie in the same page (at most `left`): a page's rows are walked by adding tok, without a division. */
static inline long page_run(const int32_t *pages, int p, int PS, int left, long tok, int *run) {
    int slot = p % PS;
    *run = PS - slot < left ? PS - slot : left;
    return ((long)pages[p / PS] * PS + slot) * tok;
}
/* The rows of positions c0 .. c0 + kc - 1 of key head kvh (of H) of a side in float, kc rows of D into dst, page
 * by page, the row PREFETCH positions ahead requested early through the page table (positions below `limit` have
 * pages); positions from own_from on (a page's first) from `own` where given (own_page). The prefetch follows the
 * sequence's pages, which are seldom adjacent once pages are reused: PREFETCH rows ahead in memory read 6.7 GB/s
 * over shuffled pages, as with no prefetch at all. Into L2, not L1 (prefetch_row): a head's rows lie a position's
 * heads apart (4 KiB for SmolLM2-1.7B's float16 pages), so every row ahead fell into the same few L1 sets and pushed
 * out the ones before it unread; so one row of 1.7B's float16 pages read 7-10 GB/s, into L2 18-19 (1024 and 4096
 * positions, 2 threads, Zen 4). */
static void load_chunk(float *dst, const kv_side *side, int kvh, int H, const int32_t *pages, int c0, int kc, int PS,
                       int D, const kv_side *own, int own_from, int limit) {
    size_t rb = kv_row_bytes(side->fmt, D);
    int ahead = c0 + PREFETCH, left = 0; /* the prefetch's position, and the rows left in its page */
    long prow = 0;
    for (int j = 0, run; j < kc;) {
        if (own && c0 + j >= own_from) { /* the row's own page as its decode step saw it (own_page) */
            load_row(dst + (size_t)j * D, own, c0 + j - own_from, D);
            j++;
            continue;
        }
        long row = page_run(pages, c0 + j, PS, kc - j, H, &run) + kvh;
        for (int k = 0; k < run; k++, j++, row += H) {
            if (ahead < limit) {
                if (!left) prow = page_run(pages, ahead, PS, limit - ahead, H, &left) + kvh;
                prefetch_row(kv_row(side, prow, D), (int)rb);
                prow += H, left--, ahead++;
            }
            load_row(dst + (size_t)j * D, side, row, D);
        }
    }
}

#define GROUP_ROWS 16 /* rows of one sequence a task takes at most (a verification step's: MAX_DRAFT + 1) */
/* Rows a task converts to float at a time, for all its rows: values, and keys that scores16 reads by rows. At 64, a
 * chunk of 128-wide heads filled a 32 KiB L1, and a GQA group's query heads each read it again: at 32, the same floats
 * (each output summed in the order of the positions) in 0.90-0.95x the time for Llama-3-8B's heads at 160 to 4096
 * positions (AVX2's build 0.92-0.94x), 0.80-1.02x for SmolLM2-1.7B's (scripts/bench_cpu_attention.py's shapes, Zen 4).
 * Keys transposed for scores_chunk (AVX2) go KEY_CHUNK at a time: its width, eight registers of eight. */
#define VALUE_CHUNK 32
#define KEY_CHUNK 64
_Static_assert(VALUE_CHUNK <= KEY_CHUNK, "a task's chunks of keys and of values share one buffer");

#if defined(LPD_AVX2) || defined(LPD_AVX512)
/* dst row i (stride ds) = column i of the 8 x 8 floats at src (row stride ss). */
static inline void transpose8(const float *src, size_t ss, float *dst, size_t ds) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ss), r2 = _mm256_loadu_ps(src + 2 * ss),
           r3 = _mm256_loadu_ps(src + 3 * ss), r4 = _mm256_loadu_ps(src + 4 * ss), r5 = _mm256_loadu_ps(src + 5 * ss),
           r6 = _mm256_loadu_ps(src + 6 * ss), r7 = _mm256_loadu_ps(src + 7 * ss);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* S[j] = scale x q . key j for the KEY_CHUNK keys of kt (D rows of KEY_CHUNK keys: transposed), eight keys a
 * register, each score summed over d in order: a key's score costs its D / 8 multiply-adds, where one key at a time
 * (dot_head) added up a register's lanes for each. */
static inline void scores_chunk(const float *q, const float *kt, int D, float scale, float *S) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int d = 0; d < D; d++) {
        const float *k = kt + (size_t)d * KEY_CHUNK;
        __m256 x = _mm256_broadcast_ss(q + d);
        c0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k), c0), c1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 8), c1);
        c2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 16), c2), c3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 24), c3);
        c4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 32), c4), c5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 40), c5);
        c6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 48), c6), c7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 56), c7);
    }
    __m256 f = _mm256_set1_ps(scale);
    _mm256_storeu_ps(S, _mm256_mul_ps(c0, f)), _mm256_storeu_ps(S + 8, _mm256_mul_ps(c1, f));
    _mm256_storeu_ps(S + 16, _mm256_mul_ps(c2, f)), _mm256_storeu_ps(S + 24, _mm256_mul_ps(c3, f));
    _mm256_storeu_ps(S + 32, _mm256_mul_ps(c4, f)), _mm256_storeu_ps(S + 40, _mm256_mul_ps(c5, f));
    _mm256_storeu_ps(S + 48, _mm256_mul_ps(c6, f)), _mm256_storeu_ps(S + 56, _mm256_mul_ps(c7, f));
}

#if defined(LPD_AVX512)
#define ROW_SCORES_MAX_D 128 /* the widest head scores16 takes (its query in registers beside 16 sums) */
/* S[j] = scale x q . key j for 16 keys, rows of D floats at kc (D % 16 == 0, D <= ROW_SCORES_MAX_D; rows past the
 * chunk's keys zeros): each key's D products summed in 16 lanes in the order of d, the lanes then added in a tree
 * that treats every key alike (pairs of lanes two apart, then the 128-bit lanes' halves, then across them), so a
 * key's score depends on nothing but its row and q. Where the keys went through transposes of 8 x 8 first, a
 * decode row's attention over float16 pages read 7 GB/s. */
static inline void scores16(const float *q, const float *kc, int D, float scale, float *S) {
    __m512 qv[ROW_SCORES_MAX_D / 16], a[16];
    for (int t = 0; t < D / 16; t++) qv[t] = _mm512_loadu_ps(q + 16 * t);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        const float *k = kc + (size_t)j * D;
        a[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int t = 1; t < D / 16; t++) a[j] = _mm512_fmadd_ps(qv[t], _mm512_loadu_ps(k + 16 * t), a[j]);
    }
    __m512 p[8], r[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* each 128-bit lane: lanes 0 + 2 and 1 + 3 of keys 2i, 2i + 1 */
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* each 128-bit lane: its four lanes' sum of keys 4i .. 4i + 3 */
        r[i] = _mm512_add_ps(_mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(p[2 * i], p[2 * i + 1], 0xee));
    __m512 m0 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xdd));
    __m512 m1 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x88), _mm512_shuffle_f32x4(r[2], r[3], 0xdd));
    __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(m0, m1, 0x88), _mm512_shuffle_f32x4(m0, m1, 0xdd));
    _mm512_storeu_ps(S, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
}
#endif
#endif

/* s[j] = e^(s[j] - mx) for j < n, in place; returns their sum (eight at a time where the processor has AVX2). */
static float exps_in_place(float *s, int n, float mx) {
    int j = 0;
    float z = 0.f;
#if defined(LPD_AVX2) || defined(LPD_AVX512)
    __m256 zv = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        zv = _mm256_add_ps(zv, e);
    }
    z = hsum8(zv);
#endif
    for (; j < n; j++) z += s[j] = expf(s[j] - mx);
    return z;
}

/* o[0 .. D) += sum over j < kc of e[j] x row j of vc (kc rows of D floats), each o[d] summed in the order of j: a
 * stretch of 32 (or 8) outputs stays in registers over the rows, where adding a row at a time stored them again. */
static void add_values(float *o, const float *e, const float *vc, int kc, int D) {
    int d = 0;
#if defined(LPD_AVX2) || defined(LPD_AVX512)
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(o + d), a1 = _mm256_loadu_ps(o + d + 8), a2 = _mm256_loadu_ps(o + d + 16),
               a3 = _mm256_loadu_ps(o + d + 24);
        for (int j = 0; j < kc; j++) {
            const float *v = vc + (size_t)j * D + d;
            __m256 x = _mm256_broadcast_ss(e + j);
            a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v), a0), a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 16), a2), a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(o + d, a0), _mm256_storeu_ps(o + d + 8, a1);
        _mm256_storeu_ps(o + d + 16, a2), _mm256_storeu_ps(o + d + 24, a3);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a0 = _mm256_loadu_ps(o + d);
        for (int j = 0; j < kc; j++) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(e + j), _mm256_loadu_ps(vc + (size_t)j * D + d), a0);
        _mm256_storeu_ps(o + d, a0);
    }
    for (; d < D; d++)
        for (int j = 0; j < kc; j++) o[d] = fmaf(e[j], vc[(size_t)j * D + d], o[d]);
#else
    for (int j = 0; j < kc; j++)
        for (d = 0; d < D; d++) o[d] += e[j] * vc[(size_t)j * D + d];
#endif
}

/* A sequence's rows cut into groups of consecutive rows, at most `most` each (GROUP_ROWS; 1 for own_pages' steps): row_seq[t] = t's sequence,
 * group_row[g] = group g's first row (group_row[groups] = T). Returns the number of groups. */
static int row_groups(int B, const int32_t *q_starts, int *row_seq, int *group_row, int most) {
    int g = 0;
    for (int b = 0; b < B; b++)
        for (int t = q_starts[b]; t < q_starts[b + 1]; t++) {
            row_seq[t] = b;
            if ((t - q_starts[b]) % most == 0) group_row[g++] = t;
        }
    group_row[g] = q_starts[B];
    return g;
}

/* Where row t of a step over int4ch pages (a sequence's few rows, as paged_attention_ref's _as_decode_page) sees its
 * own page otherwise than the step's write left it: a row before its sequence's last, of a sequence of at most
 * GROUP_ROWS rows (a verification step's, a short chunk's), whose page the write left open, saw it in its decode
 * step rounded over the page's tokens up to its own. Returns the page's first position (-1: the page as written)
 * and rounds that view of head kvh into `own` (a page of one head: codes, scales and zeros in its buffers) for each
 * int4ch side of a->k, a->v. */
static int own_page(const attn_args *a, int t, int kvh, kv_side own[2]) {
    int b = a->row_seq[t], n = a->seq_lens[b], rows = a->q_starts[b + 1] - a->q_starts[b], i = t - a->q_starts[b];
    if (!a->stage_slots || rows < 2 || rows > GROUP_ROWS || i == rows - 1) return -1;
    int pos = n - rows + i, PS = a->PS, off = pos % PS, D = a->D, H = a->H;
    if (n >= pos - off + PS) return -1; /* its page is full: final, as the write made it */
    const kv_side *sides[2] = {a->k, a->v};
    long ss = a->stage_slots[t];
    for (int j = 0; j < 2; j++) {
        if (sides[j]->fmt != KV_I4CH) continue;
        const float *st = sides[j]->stage;
        round_channels(st + ((ss - off) * H + kvh) * D, (long)H * D, st + (ss * H + kvh) * D, off + 1, D,
                       own[j].data, D / 2, own[j].scale, own[j].zero);
    }
    return pos - off;
}

/* The first PREFETCH key and value rows of a task's positions requested at once, before its first key is read:
 * load_chunk requests each row PREFETCH positions ahead of the one it reads, so a task's first rows of each side
 * (a head's, at every step: a layer's pages have left the caches by the next one) came one demand miss after
 * another. SmolLM2-1.7B's heads over float16 pages (scripts/bench_cpu_attention.py, 2 threads, Zen 4): 0.67-0.71x
 * the time at 160 positions, 0.94-0.95x at 1024; Llama-3-8B's 0.88-0.94x at 160; int8 pages 0.89-0.95x. Also
 * requesting the next task's first rows before the values (0.97-1.2x) and int8's scales with their rows (no
 * gain) were not kept. */
static void warm_rows(const attn_args *a, int kvh, int H, const int32_t *pages, int p0, int p1, int PS, int D) {
    int end = p0 + PREFETCH < p1 ? p0 + PREFETCH : p1;
    for (int side = 0; side < 2; side++) {
        const kv_side *kv = side ? a->v : a->k;
        int rb = (int)kv_row_bytes(kv->fmt, D);
        for (int p = p0, run; p < end;) {
            long row = page_run(pages, p, PS, end - p, H, &run) + kvh;
            for (int k = 0; k < run; k++, p++, row += H) prefetch_row(kv_row(kv, row, D), rb);
        }
    }
}

/* A task: query heads hq0 .. hq0 + per - 1 of one key head, for a group of rows of one sequence, each over one
 * part of its own positions (causal: a row sees the keys up to its own). The rows walk the keys and values once
 * together: a key or value row is read (and converted from float16) once for all of them, where a task a row read
 * it once a row; each row's scores, softmax and sums are computed by the same code in the same order as where the
 * row is alone (a decode step's), so a verification step's rows are bit for bit the decode rows they check. */
static void attention_task(void *ctx, int ith, int nth) {
    const attn_args *a = ctx;
    int D = a->D, H = a->H, PS = a->PS, group = a->Hq / a->H, per = a->per, parts = group / per, splits = a->splits;
    int lo = 0, hi, tasks = a->groups * H * parts * splits;
    if (a->next) hi = tasks; /* a task at a time from the counter, for as long as it has any */
    else share(tasks, ith, nth, &lo, &hi);
    static __thread void *buf;
    static __thread size_t cap;
    for (int i = lo; i < hi; i++) {
        int task_i = a->next ? atomic_fetch_add_explicit(a->next, 1, memory_order_relaxed) : i;
        if (task_i >= tasks) break;
        int sp = task_i % splits, head_task = task_i / splits;
        int g = head_task / (H * parts), kvh = head_task / parts % H, hq0 = kvh * group + head_task % parts * per;
        int t0 = a->group_row[g], nr = a->group_row[g + 1] - t0;
        int b = a->row_seq[t0], n = a->seq_lens[b], rows = a->q_starts[b + 1] - a->q_starts[b];
        int from[GROUP_ROWS], len[GROUP_ROWS], walk0 = 1 << 30, walk1 = 0; /* each row's part; their union */
        size_t at[GROUP_ROWS + 1];
        at[0] = 0;
        for (int r = 0; r < nr; r++) {
            int pos = n - rows + (t0 + r - a->q_starts[b]);
            int first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
            int all = pos + 1 - first, j0 = (int)((long)all * sp / splits);
            len[r] = (int)((long)all * (sp + 1) / splits) - j0;
            from[r] = first + j0;
            walk0 = from[r] < walk0 ? from[r] : walk0;
            walk1 = from[r] + len[r] > walk1 ? from[r] + len[r] : walk1;
            at[r + 1] = at[r] + (size_t)per * len[r];
        }
        float *s = scratch(&buf, &cap, sizeof(float) * (at[nr] + (size_t)nr * per * D
                                                        + (size_t)(2 * KEY_CHUNK + 1) * D + KEY_CHUNK));
        if (!s) return;
        float *acc = s + at[nr], *row = acc + (size_t)nr * per * D; /* row: a float16 row in float */
        /* a chunk's value rows (or key rows) in float, its keys transposed, scores */
        float *vc = row + D, *kt = vc + (size_t)KEY_CHUNK * D, *S = kt + (size_t)KEY_CHUNK * D;
        const int32_t *pages = a->page_table + b * a->pt_stride;
        /* int4ch rows: one a group (lpd_attention), the row's own page rounded as its decode step saw it */
        static __thread void *own_buf;
        static __thread size_t own_cap;
        kv_side own[2];
        int own_from = -1;
        if (a->stage_slots) {
            char *ob = scratch(&own_buf, &own_cap, 2 * ((size_t)PS * (D / 2) + 4 * (size_t)D));
            if (!ob) return;
            for (int j = 0; j < 2; j++) {
                char *o = ob + j * ((size_t)PS * (D / 2) + 4 * (size_t)D);
                own[j] = (kv_side){o, (uint16_t *)(o + (size_t)PS * (D / 2)),
                                   (uint16_t *)(o + (size_t)PS * (D / 2) + 2 * (size_t)D), KV_I4CH, PS, 1, NULL, 0};
            }
            own_from = own_page(a, t0, kvh, own);
        }
        const kv_side *own_k = own_from >= 0 && a->k->fmt == KV_I4CH ? &own[0] : NULL;
        const kv_side *own_v = own_from >= 0 && a->v->fmt == KV_I4CH ? &own[1] : NULL;
        /* the per query heads sharing a key head take each key and value row from memory once; the rows go page by
         * page (no division a row), the row PREFETCH ahead requested early: a layer's pages have left the caches
         * by the next step, and the page table hides the stride from the hardware */
        float mx[GROUP_ROWS][MAX_GROUP];
        for (int r = 0; r < nr; r++)
            for (int h = 0; h < per; h++) mx[r][h] = -INFINITY;
        int krb = (int)kv_row_bytes(a->k->fmt, D);
        warm_rows(a, kvh, H, pages, walk0, walk1, PS, D);
#if defined(LPD_AVX2) || defined(LPD_AVX512)
#if defined(LPD_AVX512)
        const int by_rows = D % 16 == 0 && D <= ROW_SCORES_MAX_D; /* scores16's keys, else the transposed chunk's */
#else
        const int by_rows = 0;
#endif
        const int chunk = by_rows ? VALUE_CHUNK : KEY_CHUNK;
        for (int c0 = walk0; D % 8 == 0 && c0 < walk1; c0 += chunk) { /* keys a chunk at a time, transposed */
            int kc = walk1 - c0 < chunk ? walk1 - c0 : chunk;
            load_chunk(vc, a->k, kvh, H, pages, c0, kc, PS, D, own_k, own_from, walk1);
            if (kc < chunk) /* past the last key: zeros (its block of 8 goes whole); the scores past it, and
                             * past the keys transposed, are never read */
                memset(vc + (size_t)kc * D, 0, sizeof(float) * (chunk - kc) * D);
            if (!by_rows)
                for (int j = 0; j < kc; j += 8)
                    for (int d = 0; d < D; d += 8)
                        transpose8(vc + (size_t)j * D + d, D, kt + (size_t)d * KEY_CHUNK + j, KEY_CHUNK);
            for (int r = 0; r < nr; r++) {
                int j0 = from[r] > c0 ? from[r] : c0, j1 = from[r] + len[r] < c0 + kc ? from[r] + len[r] : c0 + kc;
                const float *q = a->q + (t0 + r) * a->q_t + hq0 * a->q_h;
                for (int h = 0; j0 < j1 && h < per; h++) {
#if defined(LPD_AVX512)
                    if (by_rows) /* the sixteen keys around the row's, each from its own row */
                        for (int k0 = (j0 - c0) & ~15; k0 < j1 - c0; k0 += 16)
                            scores16(q + h * a->q_h, vc + (size_t)k0 * D, D, a->scale, S + k0);
                    else
#endif
                    scores_chunk(q + h * a->q_h, kt, D, a->scale, S);
                    float *sr = s + at[r] + (size_t)h * len[r] - from[r], m = mx[r][h];
                    for (int j = j0; j < j1; j++) {
                        sr[j] = S[j - c0];
                        m = S[j - c0] > m ? S[j - c0] : m;
                    }
                    mx[r][h] = m;
                }
            }
        }
        int one_by_one = D % 8 != 0; /* the keys one at a time: other widths', and plain C's */
#else
        int one_by_one = 1;
        (void)S;
#endif
        for (int j = walk0, run; one_by_one && j < walk1;) {
            long kr0 = page_run(pages, j, PS, walk1 - j, H, &run) + kvh;
            for (int k = 0; k < run; k++, j++, kr0 += H) {
                prefetch_row(kv_row(a->k, kr0 + (long)PREFETCH * H, D), krb);
                const float *kr = (const float *)kv_row(a->k, kr0, D);
                if (own_k && j >= own_from) load_row(row, own_k, j - own_from, D), kr = row;
                else if (a->k->fmt != KV_F32) load_row(row, a->k, kr0, D), kr = row;
                for (int r = 0; r < nr; r++) {
                    if (j < from[r] || j >= from[r] + len[r]) continue;
                    const float *q = a->q + (t0 + r) * a->q_t + hq0 * a->q_h;
                    float *sr = s + at[r] + (j - from[r]);
                    for (int h = 0; h < per; h++) {
                        float sj = sr[h * len[r]] = dot_head(q + h * a->q_h, kr, D) * a->scale;
                        mx[r][h] = sj > mx[r][h] ? sj : mx[r][h];
                    }
                }
            }
        }
        float sum[GROUP_ROWS][MAX_GROUP];
        for (int r = 0; r < nr; r++)
            for (int h = 0; h < per; h++) {
                sum[r][h] = exps_in_place(s + at[r] + (size_t)h * len[r], len[r], mx[r][h]);
            }
        for (size_t d = 0; d < (size_t)nr * per * D; d++) acc[d] = 0.f;
        for (int c0 = walk0; c0 < walk1; c0 += VALUE_CHUNK) { /* the value rows a chunk at a time, in float */
            int kc = walk1 - c0 < VALUE_CHUNK ? walk1 - c0 : VALUE_CHUNK;
            load_chunk(vc, a->v, kvh, H, pages, c0, kc, PS, D, own_v, own_from, walk1);
            for (int r = 0; r < nr; r++) {
                int j0 = from[r] > c0 ? from[r] : c0, j1 = from[r] + len[r] < c0 + kc ? from[r] + len[r] : c0 + kc;
                for (int h = 0; j0 < j1 && h < per; h++)
                    add_values(acc + ((size_t)r * per + h) * D, s + at[r] + (size_t)h * len[r] + (j0 - from[r]),
                               vc + (size_t)(j0 - c0) * D, j1 - j0, D);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int h = 0; h < per; h++) {
                long head = (long)(t0 + r) * a->Hq + hq0 + h;
                const float *ah = acc + ((size_t)r * per + h) * D;
                if (splits == 1) {
                    float inv = 1.0f / sum[r][h], *o = a->out + head * D;
                    for (int d = 0; d < D; d++) o[d] = ah[d] * inv;
                } else { /* this part's max, sum and unscaled outputs, for merge_task */
                    float *p = a->part + (head * splits + sp) * (D + 2);
                    p[0] = mx[r][h];
                    p[1] = sum[r][h];
                    memcpy(p + 2, ah, sizeof(float) * D);
                }
            }
    }
}

/* Each (row, query head)'s parts joined: outputs rescaled to the largest max among them, over their joint sum. */
static void merge_task(void *ctx, int ith, int nth) {
    const attn_args *a = ctx;
    int D = a->D, splits = a->splits, lo, hi;
    share(a->T * a->Hq, ith, nth, &lo, &hi);
    for (int head = lo; head < hi; head++) {
        const float *p = a->part + (long)head * splits * (D + 2);
        float m = -INFINITY, z = 0.f, *o = a->out + (long)head * D;
        for (int sp = 0; sp < splits; sp++) m = p[sp * (D + 2)] > m ? p[sp * (D + 2)] : m;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        for (int sp = 0; sp < splits; sp++) {
            const float *ps = p + sp * (D + 2);
            if (ps[1] == 0.f) continue; /* a part without positions */
            float f = expf(ps[0] - m);
            z += f * ps[1];
            for (int d = 0; d < D; d++) o[d] += f * ps[2 + d];
        }
        float inv = 1.0f / z;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* Prefill: many rows of a sequence in a step. A task is a block of up to `qb` consecutive rows of one sequence and
 * one key head: the group's query heads of those rows, R query vectors. It walks the block's positions TILE_KC at
 * a time: the chunk's key rows in float, transposed, once for all R; the R x TILE_KC scores by register tiles (four
 * queries by sixteen keys); an online softmax (each query's running max and sum, its output rescaled where the max
 * moves); the chunk's value rows, once for all R. Where the decode task read (and converted) every key and value
 * row once per row of the prompt, and summed each score across a register. */
#define TILE_KC 64
#define TILE_ROWS 16 /* from this many rows in a step on, lpd_attention takes the tiles */

typedef struct {
    const attn_args *a;
    int qb;               /* rows a block */
    const int32_t *first; /* [B + 1]: each sequence's first block */
    atomic_int next, failed;
} tile_args;

/* S[r][0 .. 15] += scale * q_r . kt[:, j .. j + 15] for four queries (kt: D rows of TILE_KC keys). */
static inline void scores_4x16(const float *const *qv, const float *kt, int D, float scale, float *S) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    for (int d = 0; d < D; d++) {
        __m256 k0 = _mm256_loadu_ps(kt + d * TILE_KC), k1 = _mm256_loadu_ps(kt + d * TILE_KC + 8), x;
        x = _mm256_broadcast_ss(qv[0] + d), c00 = _mm256_fmadd_ps(x, k0, c00), c01 = _mm256_fmadd_ps(x, k1, c01);
        x = _mm256_broadcast_ss(qv[1] + d), c10 = _mm256_fmadd_ps(x, k0, c10), c11 = _mm256_fmadd_ps(x, k1, c11);
        x = _mm256_broadcast_ss(qv[2] + d), c20 = _mm256_fmadd_ps(x, k0, c20), c21 = _mm256_fmadd_ps(x, k1, c21);
        x = _mm256_broadcast_ss(qv[3] + d), c30 = _mm256_fmadd_ps(x, k0, c30), c31 = _mm256_fmadd_ps(x, k1, c31);
    }
    __m256 f = _mm256_set1_ps(scale);
    _mm256_storeu_ps(S, _mm256_mul_ps(c00, f)), _mm256_storeu_ps(S + 8, _mm256_mul_ps(c01, f));
    _mm256_storeu_ps(S + TILE_KC, _mm256_mul_ps(c10, f)), _mm256_storeu_ps(S + TILE_KC + 8, _mm256_mul_ps(c11, f));
    _mm256_storeu_ps(S + 2 * TILE_KC, _mm256_mul_ps(c20, f));
    _mm256_storeu_ps(S + 2 * TILE_KC + 8, _mm256_mul_ps(c21, f));
    _mm256_storeu_ps(S + 3 * TILE_KC, _mm256_mul_ps(c30, f));
    _mm256_storeu_ps(S + 3 * TILE_KC + 8, _mm256_mul_ps(c31, f));
}

/* o0, o1 [D] += sum over the chunk's kc keys of p0[j], p1[j] times value row vc[j] (vc: kc rows of D floats). */
static inline void values_2(const float *p0, const float *p1, const float *vc, int kc, int D, float *o0, float *o1) {
    int d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(o0 + d), a1 = _mm256_loadu_ps(o0 + d + 8), a2 = _mm256_loadu_ps(o0 + d + 16),
               a3 = _mm256_loadu_ps(o0 + d + 24), b0 = _mm256_loadu_ps(o1 + d), b1 = _mm256_loadu_ps(o1 + d + 8),
               b2 = _mm256_loadu_ps(o1 + d + 16), b3 = _mm256_loadu_ps(o1 + d + 24);
        for (int j = 0; j < kc; j++) {
            const float *vr = vc + (size_t)j * D + d;
            __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8), v2 = _mm256_loadu_ps(vr + 16),
                   v3 = _mm256_loadu_ps(vr + 24), x = _mm256_broadcast_ss(p0 + j), y = _mm256_broadcast_ss(p1 + j);
            a0 = _mm256_fmadd_ps(x, v0, a0), a1 = _mm256_fmadd_ps(x, v1, a1);
            a2 = _mm256_fmadd_ps(x, v2, a2), a3 = _mm256_fmadd_ps(x, v3, a3);
            b0 = _mm256_fmadd_ps(y, v0, b0), b1 = _mm256_fmadd_ps(y, v1, b1);
            b2 = _mm256_fmadd_ps(y, v2, b2), b3 = _mm256_fmadd_ps(y, v3, b3);
        }
        _mm256_storeu_ps(o0 + d, a0), _mm256_storeu_ps(o0 + d + 8, a1);
        _mm256_storeu_ps(o0 + d + 16, a2), _mm256_storeu_ps(o0 + d + 24, a3);
        _mm256_storeu_ps(o1 + d, b0), _mm256_storeu_ps(o1 + d + 8, b1);
        _mm256_storeu_ps(o1 + d + 16, b2), _mm256_storeu_ps(o1 + d + 24, b3);
    }
    for (; d < D; d += 8) { /* D is a multiple of 8 */
        __m256 a0 = _mm256_loadu_ps(o0 + d), b0 = _mm256_loadu_ps(o1 + d);
        for (int j = 0; j < kc; j++) {
            __m256 v0 = _mm256_loadu_ps(vc + (size_t)j * D + d);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j), v0, a0);
            b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + j), v0, b0);
        }
        _mm256_storeu_ps(o0 + d, a0), _mm256_storeu_ps(o1 + d, b0);
    }
}

static void tile_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    tile_args *ta = ctx;
    const attn_args *a = ta->a;
    int D = a->D, H = a->H, PS = a->PS, group = a->Hq / a->H, qb = ta->qb, B = a->B;
    int n_blocks = ta->first[B], tasks = n_blocks * H, rmax = (qb * group + 3) / 4 * 4;
    static __thread void *buf;
    static __thread size_t cap;
    size_t need = (size_t)TILE_KC * D * 2 + (size_t)rmax * (TILE_KC + D + 2) + D;
    float *kt = scratch(&buf, &cap, sizeof(float) * need + sizeof(float *) * rmax);
    if (!kt) {
        atomic_store(&ta->failed, 1);
        return;
    }
    float *vc = kt + (size_t)TILE_KC * D, *S = vc + (size_t)TILE_KC * D, *O = S + (size_t)rmax * TILE_KC;
    float *mx = O + (size_t)rmax * D, *sum = mx + rmax, *row = sum + rmax;
    const float **qv = (const float **)(row + D);
    for (;;) {
        int task = atomic_fetch_add_explicit(&ta->next, 1, memory_order_relaxed);
        if (task >= tasks) break;
        int blk = n_blocks - 1 - task / H, kvh = task % H, b = 0; /* the last blocks (the most positions) first */
        while (ta->first[b + 1] <= blk) b++;
        int n = a->seq_lens[b], rows = a->q_starts[b + 1] - a->q_starts[b], r0 = (blk - ta->first[b]) * qb;
        int nr = rows - r0 < qb ? rows - r0 : qb, R = nr * group, t0 = a->q_starts[b] + r0;
        int pos0 = n - rows + r0, hi = pos0 + nr; /* positions [lo, hi) */
        int lo = a->window > 0 && pos0 - a->window + 1 > 0 ? pos0 - a->window + 1 : 0;
        for (int r = 0; r < rmax; r++) { /* the vectors past R repeat the first: computed, never used */
            int rr = r < R ? r : 0;
            qv[r] = a->q + (long)(t0 + rr / group) * a->q_t + (long)(kvh * group + rr % group) * a->q_h;
            mx[r] = -INFINITY, sum[r] = 0.f;
        }
        memset(O, 0, sizeof(float) * (size_t)rmax * D);
        const int32_t *pages = a->page_table + b * a->pt_stride;
        for (int j0 = lo; j0 < hi; j0 += TILE_KC) {
            int kc = hi - j0 < TILE_KC ? hi - j0 : TILE_KC;
            for (int j = 0, run; j < kc;) { /* the chunk's keys transposed into kt, its values into vc */
                long r0 = page_run(pages, j0 + j, PS, kc - j, H, &run) + kvh;
                for (int r = 0; r < run; r++, j++, r0 += H) {
                    load_row(row, a->k, r0, D);
                    for (int d = 0; d < D; d++) kt[d * TILE_KC + j] = row[d];
                    load_row(vc + (size_t)j * D, a->v, r0, D);
                }
            }
            for (int j = kc; j < (kc + 15) / 16 * 16; j++) /* the last tile's keys past the chunk: zeros */
                for (int d = 0; d < D; d++) kt[d * TILE_KC + j] = 0.f;
            for (int r = 0; r < rmax; r += 4)
                for (int j = 0; j < kc; j += 16) scores_4x16(qv + r, kt + j, D, a->scale, S + (size_t)r * TILE_KC + j);
            for (int r = 0; r < R; r++) { /* each query's positions in the chunk: causal, and its window */
                int pos = pos0 + r / group, first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
                int from = first - j0 > 0 ? first - j0 : 0, to = pos + 1 - j0 < kc ? pos + 1 - j0 : kc;
                float *sr = S + (size_t)r * TILE_KC, m = -INFINITY;
                if (from >= to) { /* none: the query's output stays as it is */
                    memset(sr, 0, sizeof(float) * kc);
                    continue;
                }
                for (int j = from; j < to; j++) m = sr[j] > m ? sr[j] : m;
                float top = m > mx[r] ? m : mx[r], keep = expf(mx[r] - top), z = 0.f;
                int j = 0;
                for (; j < from; j++) sr[j] = 0.f;
                for (; j + 8 <= to; j += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), _mm256_set1_ps(top)));
                    _mm256_storeu_ps(sr + j, e);
                    z += hsum8(e);
                }
                for (; j < to; j++) z += sr[j] = expf(sr[j] - top);
                for (; j < kc; j++) sr[j] = 0.f;
                if (keep != 1.f) {
                    float *o = O + (size_t)r * D;
                    for (int d = 0; d < D; d++) o[d] *= keep;
                }
                mx[r] = top, sum[r] = sum[r] * keep + z;
            }
            for (int r = 0; r < R; r += 2) {
                int r1 = r + 1 < R ? r + 1 : r; /* an odd last query: its pair is itself, added to a copy */
                float *o1 = r1 == r ? row : O + (size_t)r1 * D;
                values_2(S + (size_t)r * TILE_KC, S + (size_t)r1 * TILE_KC, vc, kc, D, O + (size_t)r * D, o1);
            }
        }
        for (int r = 0; r < R; r++) {
            float inv = 1.0f / sum[r], *o = a->out + ((long)(t0 + r / group) * a->Hq + kvh * group + r % group) * D;
            for (int d = 0; d < D; d++) o[d] = O[(size_t)r * D + d] * inv;
        }
    }
}

/* The tiled prefill, where it applies: 1 done, 0 not taken (the per-row tasks run), -1 without memory. */
static int tile_attention(const attn_args *a, int nth) {
    int group = a->Hq / a->H;
    if (a->T < TILE_ROWS || a->D % 8) return 0;
    static __thread void *buf;
    static __thread size_t cap;
    int32_t *first = scratch(&buf, &cap, sizeof(int32_t) * (size_t)(a->B + 1));
    if (!first) return -1;
    int qb = 64 / group > 1 ? 64 / group : 1;
    first[0] = 0;
    for (int b = 0; b < a->B; b++) first[b + 1] = first[b] + (a->q_starts[b + 1] - a->q_starts[b] + qb - 1) / qb;
    tile_args ta = {a, qb, first, 0, 0};
    parallel(tile_task, &ta, nth);
    return atomic_load(&ta.failed) ? -1 : 1;
}
#endif

/* Whether the step's tables stay inside the pool (a sequence's rows within its length, its pages within the page
 * table's width and the pool, its slots within the pool): -2 where they do not, so that a caller's bug is an error,
 * not a read or write of memory outside the pages. */
static int check_tables(int T, int B, const int32_t *seq_lens, const int32_t *q_starts, const int32_t *page_table,
                        long pt_stride, int pt_width, int n_pages, int PS, const int64_t *slots) {
    if (q_starts[0] != 0 || q_starts[B] != T) return -2;
    for (int b = 0; b < B; b++) {
        int n = seq_lens[b], rows = q_starts[b + 1] - q_starts[b], pages = (n + PS - 1) / PS;
        if (rows < 0 || rows > n || pages > pt_width) return -2;
        for (int i = 0; i < pages; i++)
            if (page_table[b * pt_stride + i] < 0 || page_table[b * pt_stride + i] >= n_pages) return -2;
    }
    for (int t = 0; slots && t < T; t++)
        if (slots[t] < 0 || slots[t] >= (int64_t)n_pages * PS) return -2;
    return 0;
}

/* How a step's attention is cut into tasks: each takes the query heads of a key head (at most MAX_GROUP, a divisor
 * of the group) of a group of rows (row_groups) so that a key or value row is read once for all of them, and each
 * row's positions are cut into `splits` parts where that leaves fewer than two tasks a thread (a decode row of a
 * model with few key heads), each part at least 16 positions of the shortest row (`shortest`). Counted by groups,
 * not rows, so that a verification step's rows of one sequence are cut as its decode row is. */
typedef struct {
    int per, splits;
} attn_shape;

static attn_shape attention_shape(int groups, int Hq, int H, int nth, int shortest) {
    int group = Hq / H, per = group;
    while (per > MAX_GROUP || group % per) per--;
    long tasks = (long)groups * H * (group / per), want = 2L * nth;
    int splits = tasks >= want ? 1 : (int)((want + tasks - 1) / tasks), most = shortest / 16 > 1 ? shortest / 16 : 1;
    return (attn_shape){per, splits < most ? splits : most};
}

/* The fewest positions a row of the step attends to (its window's, or its whole sequence's). */
static int shortest_row(int B, const int32_t *seq_lens, const int32_t *q_starts, int window) {
    int least = 1 << 30;
    for (int b = 0; b < B; b++) {
        int rows = q_starts[b + 1] - q_starts[b], n = seq_lens[b] - rows + 1; /* the first row's */
        if (rows > 0) least = n < least ? n : least;
    }
    return window > 0 && window < least ? window : least;
}

/* Whether a step's rows over int4ch pages must see their own pages as their decode steps did (own_page): some
 * sequence has 2 to GROUP_ROWS rows. */
static int own_pages(const kv_side *k, const kv_side *v, const int64_t *stage_slots, int B, const int32_t *q_starts) {
    if (!stage_slots || (k->fmt != KV_I4CH && v->fmt != KV_I4CH)) return 0;
    for (int b = 0; b < B; b++)
        if (q_starts[b + 1] - q_starts[b] >= 2 && q_starts[b + 1] - q_starts[b] <= GROUP_ROWS) return 1;
    return 0;
}

/* out [T, Hq, D] (contiguous) = attention of q (row stride q_t, head stride q_h, in floats) over the pages; the page
 * table is [B, pt_width] (row stride pt_stride) into a pool of n_pages pages; stage_slots: the rows' stage slots
 * over int4ch pages (own_page; else NULL). Returns 0, -1 without memory, or -2 where the tables leave the pool
 * (check_tables). */
int lpd_attention(const float *q, long q_t, long q_h, int T, int Hq, int D, const kv_side *k, const kv_side *v,
                  int PS, int H, const int32_t *page_table, long pt_stride, int pt_width, int n_pages,
                  const int32_t *seq_lens, const int32_t *q_starts, int B, float scale, int window,
                  const int64_t *stage_slots, float *out, int nth) {
    if (check_tables(T, B, seq_lens, q_starts, page_table, pt_stride, pt_width, n_pages, PS, NULL)) return -2;
    static __thread void *buf;
    static __thread size_t cap;
    int *rows = scratch(&buf, &cap, sizeof(int) * (2 * (size_t)T + 1)); /* row_seq, then group_row */
    if (!rows) return -1;
    int groups = row_groups(B, q_starts, rows, rows + T, GROUP_ROWS), own = own_pages(k, v, stage_slots, B, q_starts);
    attn_shape shape = attention_shape(groups, Hq, H, nth, shortest_row(B, seq_lens, q_starts, window));
    if (own) groups = row_groups(B, q_starts, rows, rows + T, 1); /* each row its own page: a row a group */
    for (int t = 0; own && t < T; t++) { /* a row's stage slot at its position's offset, inside the stages */
        int b = rows[t], pos = seq_lens[b] - (q_starts[b + 1] - t);
        if (stage_slots[t] < 0 || stage_slots[t] % PS != pos % PS ||
            (k->fmt == KV_I4CH && (stage_slots[t] >= k->n_stage || !k->stage)) ||
            (v->fmt == KV_I4CH && (stage_slots[t] >= v->n_stage || !v->stage)))
            return -2;
    }
    static __thread void *part_buf;
    static __thread size_t part_cap;
    size_t parts = shape.splits > 1 ? (size_t)T * Hq * shape.splits * (D + 2) : 0;
    float *part = parts ? scratch(&part_buf, &part_cap, sizeof(float) * parts) : NULL;
    if (parts && !part) return -1;
    attn_args a = {q, q_t, q_h, T, Hq, D, H, PS, B, window, k, v, page_table, seq_lens, q_starts, pt_stride,
                   scale, out, rows, rows + T, groups, shape.per, shape.splits, part, NULL,
                   own ? stage_slots : NULL};
#if defined(LPD_AVX512) || defined(LPD_AVX2)
    int tiled = own ? 0 : tile_attention(&a, nth); /* the tiles take a step's rows in blocks */
    if (tiled) return tiled > 0 ? 0 : -1;
#endif
    parallel(attention_task, &a, nth);
    if (shape.splits > 1) parallel(merge_task, &a, nth);
    return 0;
}

/* RoPE (HF's half-rotated layout) on the n_heads query and n_kv key heads of each row of qkv [T, (n_heads + 2 n_kv)
 * * D] (row stride qkv_t), in place; cos, sin [T, D/2] (row stride cs_t); then each row's key and value heads into
 * pages of the sides k, v at slots[t] (slot = page * PS + offset; a page [PS, n_kv, D]), of n_slots in the
 * pool: -2 (nothing written) where a slot is outside it. */
/* rope_write's rows t0 .. t1 - 1 (slots already checked); rotate 0: the heads as they are (a layer without RoPE). */
static void rope_rows(float *qkv, long qkv_t, int t0, int t1, int n_heads, int n_kv, int D, const float *cos,
                      const float *sin, long cs_t, int rotate, const int64_t *slots, const int64_t *stage_slots,
                      kv_side *k, kv_side *v) {
    int hd = D / 2;
    for (int t = t0; t < t1; t++) {
        float *row = qkv + t * qkv_t;
        const float *c = cos + t * cs_t, *s = sin + t * cs_t;
        for (int h = 0; rotate && h < n_heads + n_kv; h++) {
            float *x = row + (long)h * D;
            for (int i = 0; i < hd; i++) {
                float x1 = x[i], x2 = x[hd + i];
                x[i] = x1 * c[i] - x2 * s[i];
                x[hd + i] = x2 * c[i] + x1 * s[i];
            }
        }
        /* the step's last token in its page (a sequence's rows are consecutive, in order): int4ch rounds it then */
        int ps = k->fmt == KV_I4CH ? k->ps : v->fmt == KV_I4CH ? v->ps : 0;
        int last = !ps || t == t1 - 1 || slots[t + 1] / ps != slots[t] / ps;
        for (int h = 0; h < n_kv; h++) {
            kv_side *sides[2] = {k, v};
            for (int i = 0; i < 2; i++) {
                const float *x = row + (long)(n_heads + i * n_kv + h) * D;
                if (sides[i]->fmt == KV_I4CH) store_page_head(sides[i], slots[t], stage_slots[t], h, x, D, last);
                else store_head(sides[i], slots[t] * n_kv + h, x, D);
            }
        }
    }
}

/* Whether every token's stage slot lies in its int4ch sides' stages, at its page's offset (-2 where not, or where
 * an int4ch side has no stage slots). */
static int check_stage(int T, int PS, const int64_t *slots, const int64_t *stage_slots, const kv_side *k,
                       const kv_side *v) {
    const kv_side *sides[2] = {k, v};
    for (int i = 0; i < 2; i++) {
        if (sides[i]->fmt != KV_I4CH) continue;
        if (!stage_slots || !sides[i]->stage || sides[i]->ps != PS) return -2;
        for (int t = 0; t < T; t++)
            if (stage_slots[t] < 0 || stage_slots[t] >= sides[i]->n_stage || stage_slots[t] % PS != slots[t] % PS)
                return -2;
    }
    return 0;
}

/* stage_slots: each token's place in the int4ch sides' stages (NULL where neither side is int4ch); PS: tokens a
 * page. The tokens are written in turn, so a sequence's rows of one page (a prefill chunk) leave it rounded over
 * all of them. */
int lpd_rope_write(float *qkv, long qkv_t, int T, int n_heads, int n_kv, int D, const float *cos, const float *sin,
                   long cs_t, const int64_t *slots, const int64_t *stage_slots, int PS, kv_side *k, kv_side *v,
                   long n_slots) {
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= n_slots) return -2;
    if (check_stage(T, PS, slots, stage_slots, k, v)) return -2;
    rope_rows(qkv, qkv_t, 0, T, n_heads, n_kv, D, cos, sin, cs_t, 1, slots, stage_slots, k, v);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * Rows n0 .. n1 - 1 of an int4 or int8 weight as floats, out [(n1 - n0), K]: what a prefill chunk's GEMM (torch's,
 * compute-bound) multiplies, a slice at a time. */
typedef struct {
    int bits, group, K, n0, n1;
    const uint8_t *w;
    const uint16_t *scales, *biases;
    const uint8_t *sub; /* int4-k (gemm_args) */
    const int8_t *lut;  /* a codebook weight (gemm_args) */
    float *out;
    const uint8_t *high; /* a 5-bit weight's fifth bits (gemm_args; its groups are blocks) */
    const uint8_t *top;  /* Q6_K's upper bits, with sc16 its scales (gemm_args) */
    const int8_t *sc16;
    const int8_t *mn16; /* Q2_K's minima (gemm_args) */
} dequant_args;

/* A 5-bit weight's fifth bits of block b of row n (fifth32's). */
static inline uint32_t dequant_fifth(const dequant_args *a, int n, int b) {
    return fifth_word(a->high + (size_t)n * (a->K / 8), a->K, b);
}

#if defined(LPD_AVX512) || defined(LPD_AVX2)
/* Group g of weight row n (scale s, int4 bias m) into o, 16 values a step (AVX2); 0 where the group is not a
 * multiple of 16 (the scalar loop takes it). An int4 byte holds two columns, the low nibble first. */
static inline int dequant_group8(const dequant_args *a, int n, int g, float s, float m, float *o) {
    int G = a->group, K = a->K;
    if (G % 16 || (a->lut && G != 32)) return 0;
    __m256 vs = _mm256_set1_ps(s);
    if (a->lut) { /* a group is a block (codebook_code) */
        __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a->lut));
        __m256i v = _mm256_shuffle_epi8(tab, codebook_block(a->w + (size_t)n * (K / 2), K / 32, g));
        __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
        for (int i = 0; i < 2; i++) {
            _mm256_storeu_ps(o + 16 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h[i])), vs));
            _mm256_storeu_ps(o + 16 * i + 8,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h[i], 8))), vs));
        }
    } else if (a->bits == 4) {
        __m256 vm = _mm256_set1_ps(m);
        const uint8_t *p = a->w + (size_t)n * (K / 2) + g * (G / 2);
        __m128i mask = _mm_set1_epi8(15);
        uint32_t f = a->high ? dequant_fifth(a, n, g) : 0; /* a 5-bit weight's groups are its blocks */
        for (int j = 0; j < G / 2; j += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(p + j));
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            if (a->high) { /* bytes j .. j + 7: fifth bits j .. j + 7 (low nibbles), 16 + j .. 23 + j (high) */
                lo = _mm_or_si128(lo, fifth_bytes(f >> j & 0xff));
                hi = _mm_or_si128(hi, fifth_bytes(f >> (16 + j) & 0xff));
            }
            __m128i both = _mm_unpacklo_epi8(lo, hi);
            __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
            __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)));
            _mm256_storeu_ps(o + 2 * j, _mm256_fmadd_ps(v0, vs, vm));
            _mm256_storeu_ps(o + 2 * j + 8, _mm256_fmadd_ps(v1, vs, vm));
        }
    } else {
        const int8_t *p = (const int8_t *)a->w + (size_t)n * K + g * G;
        for (int j = 0; j < G; j += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(p + j));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs));
            _mm256_storeu_ps(o + j + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))),
                                                      vs));
        }
    }
    return 1;
}
#endif

/* Q6_K's (or Q3_K's) row n into o [K]: (q - offset) x (d x sc), ggml's one product, a sub-block of 16 at a time
 * (AVX2: its codes as bytes, the nibbles and the upper bits, in column order); Q2_K's q x (d x sc) - dmin x mn, its
 * product exact, so one rounding as ggml's. */
static void dequant_q6k_row(const dequant_args *a, int n, float *o) {
    int K = a->K, nb = K / 32, offset = sub16_offset(a->high, a->top, a->mn16);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = a->w + (size_t)n * (K / 2) + b * 16;
        const uint8_t *u = a->top ? upper_group(a->top, (size_t)n * (K / 4), b) : NULL;
        for (int h = 0; h < 2; h++) { /* sub-block h: bytes 8h .. 8h + 7 (columns 16h .. 16h + 15) */
            float s = q6k_scale(a->scales, a->sc16, K, n, 2 * b + h);
            float mn = q2k_minimum(a->biases, a->mn16, K, n, 2 * b + h);
            const uint8_t *q = p + 8 * h;
#if defined(LPD_AVX512) || defined(LPD_AVX2)
            __m128i raw = _mm_loadl_epi64((const __m128i *)q), mask = _mm_set1_epi8(15);
            __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            if (u) {
                lo = _mm_or_si128(lo, upper_bytes128(_mm_loadl_epi64((const __m128i *)(u + 8 * h)), b & 3));
                hi = _mm_or_si128(hi, upper_bytes128(_mm_loadl_epi64((const __m128i *)(u + 16 + 8 * h)), b & 3));
            }
            __m128i both = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8((char)offset)); /* in column order */
            __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(mn);
            for (int half = 0; half < 2; half++) {
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half ? _mm_srli_si128(both, 8) : both));
                _mm256_storeu_ps(o + 32 * b + 16 * h + 8 * half, _mm256_fmsub_ps(v, vs, vm));
            }
#else
            for (int j = 0; j < 8; j++) {
                int e = 8 * h + j;
                int c0 = (q[j] & 15) | (u ? upper_code(u[e], b & 3) : 0);
                int c1 = (q[j] >> 4) | (u ? upper_code(u[16 + e], b & 3) : 0);
                o[32 * b + 2 * e] = (float)(c0 - offset) * s - mn;
                o[32 * b + 2 * e + 1] = (float)(c1 - offset) * s - mn;
            }
#endif
        }
    }
}

/* Group g of row n's scale and bias: int4-k's from its row's ws, wb (k_group_scales), else the stored float16s
 * (a bias for int4 only). */
static inline void group_factors(const dequant_args *a, int n, int ng, int g, const float *ws, const float *wb,
                                 float *s, float *m) {
    *s = a->sub ? ws[g] : half_to_float(a->scales[(size_t)n * ng + g]);
    *m = a->sub ? wb[g] : !deinterleaved(a->bits, a->lut) ? 0.f
       : a->biases ? half_to_float(a->biases[(size_t)n * ng + g]) : symmetric_bias(a->high) * *s;
}

/* Rows r0 .. r1 - 1 of the weight, dequantized to float into out [r1 - r0, K]. */
static void dequant_rows(const dequant_args *a, int r0, int r1, float *out) {
    if (a->sc16) {
        for (int n = r0; n < r1; n++) dequant_q6k_row(a, n, out + (size_t)(n - r0) * a->K);
        return;
    }
    int K = a->K, ng = K / a->group;
    float ws[ng], wb[ng];
    for (int n = r0; n < r1; n++) {
        float *o = out + (size_t)(n - r0) * K;
        if (a->sub) k_group_scales(k_row_at(a->scales, a->biases, a->sub, n, ng), ng, ws, wb);
        for (int g = 0; g < ng; g++) {
            float s, m;
            group_factors(a, n, ng, g, ws, wb, &s, &m);
#if defined(LPD_AVX512) || defined(LPD_AVX2)
            if (dequant_group8(a, n, g, s, m, o + g * a->group)) continue;
#endif
            if (a->lut) { /* a group is a block */
                for (int j = 0; j < 32; j++)
                    o[g * 32 + j] = (float)a->lut[codebook_code(a->w + (size_t)n * (K / 2), ng, g, j)] * s;
            } else if (a->bits == 4) {
                const uint8_t *p = a->w + (size_t)n * (K / 2) + g * (a->group / 2);
                uint32_t f = a->high ? dequant_fifth(a, n, g) : 0;
                for (int j = 0; j < a->group / 2; j++) {
                    o[g * a->group + 2 * j] = (float)((p[j] & 15) | (f >> j & 1) << 4) * s + m;
                    o[g * a->group + 2 * j + 1] = (float)((p[j] >> 4) | (f >> (16 + j) & 1) << 4) * s + m;
                }
            } else {
                const int8_t *p = (const int8_t *)a->w + (size_t)n * K + g * a->group;
                for (int j = 0; j < a->group; j++) o[g * a->group + j] = (float)p[j] * s;
            }
        }
    }
}

static void dequant_task(void *ctx, int ith, int nth) {
    const dequant_args *a = ctx;
    int lo, hi;
    share(a->n1 - a->n0, ith, nth, &lo, &hi);
    dequant_rows(a, a->n0 + lo, a->n0 + hi, a->out + (size_t)lo * a->K);
}

void lpd_dequantize(int bits, const void *w, const uint16_t *scales, const uint16_t *biases, const uint8_t *sub,
                    const int8_t *lut, const uint8_t *high, const uint8_t *top, const int8_t *sc16, const int8_t *mn16,
                    int group, int K, int n0, int n1, float *out, int nth) {
    dequant_args a = {bits, group, K, n0, n1, w, scales, biases, sub, lut, out, high, top, sc16, mn16};
    parallel(dequant_task, &a, nth);
}

/* The BLAS sgemm (Fortran interface) torch was built with, handed in by kernels/cpu.py; NULL: none. */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);
static sgemm_fn blas_sgemm;
void lpd_set_sgemm(void *fn) { blas_sgemm = (sgemm_fn)fn; }
/* MKL's cblas_gemm_bf16bf16f32 (bfloat16 operands, float32 sums and output; AMX or AVX512-BF16 where the
 * processor has them), handed in by kernels/cpu.py where it takes it; NULL: float32 GEMMs only. */
typedef void (*bf16gemm_fn)(int, int, int, int, int, int, float, const uint16_t *, int, const uint16_t *, int, float,
                            float *, int);
static bf16gemm_fn blas_bf16gemm;
void lpd_set_bf16gemm(void *fn) { blas_bf16gemm = (bf16gemm_fn)fn; }

/* n floats to bfloat16, rounded to nearest even (finite values: dequantized weights). */
static void to_bf16(const float *x, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

#if defined(LPD_AVX512)
/* 16 floats -> their bfloat16 bits (to_bf16's rounding), as 16 uint16. */
static inline __m256i bf16_of(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* A block's fifth bits (32) into its 16 bytes of low and high codes. */
static inline void or_plane(__m128i *lo, __m128i *hi, uint32_t bits) {
    *lo = _mm_or_si128(*lo, fifth_bytes(bits & 0xffff));
    *hi = _mm_or_si128(*hi, fifth_bytes(bits >> 16));
}

/* dequant_rows then to_bf16, the same bits, without the slice's floats going through memory: rows r0 .. r1 - 1
 * into out [r1 - r0, K] bfloat16. int4 (int4-k and the 5-bit weights among them), int8, codebook and the
 * sub-block-of-16 weights (Q6_K, Q3_K) in registers (the same products as dequant_group8's and dequant_q6k_row's,
 * the same rounding); the rest (groups not in blocks of 32) a row at a time through `row` (K floats, in L1). */
static void dequant_rows_bf16(const dequant_args *a, int r0, int r1, uint16_t *out, float *row) {
    int K = a->K, G = a->group, ng = K / G;
    const __m128i mask = _mm_set1_epi8(15);
    if (a->sc16) { /* Q6_K, Q3_K, Q2_K: dequant_q6k_row's values, a block of 32 (two sub-blocks) a step */
        int nb = K / 32;
        __m128i offset = _mm_set1_epi8((char)sub16_offset(a->high, a->top, a->mn16));
        for (int n = r0; n < r1; n++) {
            uint16_t *o = out + (size_t)(n - r0) * K;
            for (int b = 0; b < nb; b++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(a->w + (size_t)n * (K / 2) + b * 16));
                __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                if (a->top) or_upper(&lo, &hi, upper_group(a->top, (size_t)n * (K / 4), b), b & 3); /* (Q3_K: none) */
                __m128i c[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)}; /* sub-blocks 2b, 2b + 1 */
                for (int h = 0; h < 2; h++) {
                    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(c[h], offset)));
                    __m512 vs = _mm512_set1_ps(q6k_scale(a->scales, a->sc16, K, n, 2 * b + h));
                    __m512 vm = _mm512_set1_ps(q2k_minimum(a->biases, a->mn16, K, n, 2 * b + h));
                    _mm256_storeu_si256((__m256i *)(o + 32 * b + 16 * h), bf16_of(_mm512_fmsub_ps(v, vs, vm)));
                }
            }
        }
        return;
    }
    if (a->lut && G == 32) { /* a codebook: each block's codes looked up (dequant_group8's values), times its scale */
        __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a->lut));
        for (int n = r0; n < r1; n++) {
            uint16_t *o = out + (size_t)(n - r0) * K;
            for (int g = 0; g < ng; g++) {
                __m256i v = _mm256_shuffle_epi8(tab, codebook_block(a->w + (size_t)n * (K / 2), ng, g));
                __m512 vs = _mm512_set1_ps(half_to_float(a->scales[(size_t)n * ng + g]));
                __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
                for (int i = 0; i < 2; i++)
                    _mm256_storeu_si256((__m256i *)(o + 32 * g + 16 * i),
                                        bf16_of(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h[i])), vs)));
            }
        }
        return;
    }
    if (a->lut || (a->bits == 4 ? G % 32 : G % 16) || (a->high && G != 32)) {
        for (int n = r0; n < r1; n++) {
            dequant_rows(a, n, n + 1, row);
            uint16_t *o = out + (size_t)(n - r0) * K;
            int j = 0;
            for (; j + 16 <= K; j += 16) _mm256_storeu_si256((__m256i *)(o + j), bf16_of(_mm512_loadu_ps(row + j)));
            to_bf16(row + j, o + j, (size_t)(K - j));
        }
        return;
    }
    float ws[ng], wb[ng];
    for (int n = r0; n < r1; n++) {
        uint16_t *o = out + (size_t)(n - r0) * K;
        if (a->sub) k_group_scales(k_row_at(a->scales, a->biases, a->sub, n, ng), ng, ws, wb);
        for (int g = 0; g < ng; g++) {
            float s, m;
            group_factors(a, n, ng, g, ws, wb, &s, &m);
            __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
            uint16_t *og = o + (size_t)g * G;
            if (a->bits == 4) {
                const uint8_t *p = a->w + (size_t)n * (K / 2) + g * (G / 2);
                uint32_t f = a->high ? dequant_fifth(a, n, g) : 0;
                for (int j = 0; j < G / 2; j += 16) { /* 16 bytes: columns 2j .. 2j + 31 */
                    __m128i b = _mm_loadu_si128((const __m128i *)(p + j));
                    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                    if (a->high) or_plane(&lo, &hi, f);
                    __m128i c[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
                    for (int i = 0; i < 2; i++) {
                        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c[i])), vs, vm);
                        _mm256_storeu_si256((__m256i *)(og + 2 * j + 16 * i), bf16_of(v));
                    }
                }
            } else {
                const int8_t *p = (const int8_t *)a->w + (size_t)n * K + g * G;
                for (int j = 0; j < G; j += 16) {
                    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + j))));
                    _mm256_storeu_si256((__m256i *)(og + j), bf16_of(_mm512_mul_ps(v, vs)));
                }
            }
        }
    }
}
#endif

/* y [M, N] = h [M, K] @ weight^T: each thread takes `slice` weight rows at a time from a counter, dequantizes them
 * into a buffer of its own that stays in its core's L2 cache, and multiplies them by all M rows with a
 * single-threaded sgemm (inside the parallel region the BLAS runs on the calling thread). Where the whole weight
 * was dequantized first, its float copy went out to the L3 cache or memory and came back for the GEMM. */
typedef struct {
    dequant_args w;
    int M, slice;
    const float *h;
    const uint16_t *h16; /* where given: h in bfloat16, [M, K] */
    float *y;
    atomic_int next, failed;
} dq_gemm_args;

static void dq_gemm_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    dq_gemm_args *a = ctx;
    int K = a->w.K, N = a->w.n1;
    static __thread void *buf;
    static __thread size_t cap;
    size_t slice = (size_t)a->slice * K;
    float *b = scratch(&buf, &cap, (sizeof(float) + (a->h16 ? 2 : 0)) * slice);
    if (!b) {
        atomic_store(&a->failed, 1);
        return;
    }
    uint16_t *b16 = (uint16_t *)(b + slice);
    const float one = 1.f, zero = 0.f;
    for (;;) {
        int n0 = atomic_fetch_add_explicit(&a->next, a->slice, memory_order_relaxed);
        if (n0 >= N) break;
        int rows = N - n0 < a->slice ? N - n0 : a->slice;
#if defined(LPD_AVX512)
        if (a->h16)
            dequant_rows_bf16(&a->w, n0, n0 + rows, b16, b);
        else
#endif
        dequant_rows(&a->w, n0, n0 + rows, b);
        if (a->h16) { /* y = h16 @ w16^T (row-major, B transposed), float32 sums */
#if !defined(LPD_AVX512)
            to_bf16(b, b16, (size_t)rows * K);
#endif
            blas_bf16gemm(101, 111, 112, a->M, rows, K, 1.f, a->h16, K, b16, K, 0.f, a->y + n0, N);
        } else {
            blas_sgemm("T", "N", &rows, &a->M, &K, &one, b, &K, a->h, &K, &zero, a->y + n0, &N);
        }
    }
}

/* h16: where given, h in bfloat16 ([M, K]), multiplied by the weight rounded to bfloat16 with lpd_set_bf16gemm's
 * GEMM. Returns 0, -1 without memory, -3 without a BLAS (lpd_set_sgemm, lpd_set_bf16gemm). */
int lpd_dequant_gemm(int bits, const void *w, const uint16_t *scales, const uint16_t *biases, const uint8_t *sub,
                     const int8_t *lut, const uint8_t *high, const uint8_t *top, const int8_t *sc16,
                     const int8_t *mn16, int group, int K, int N, int M, const float *h, const uint16_t *h16, float *y,
                     int slice, int nth) {
    if (!blas_sgemm || (h16 && !blas_bf16gemm)) return -3;
    dq_gemm_args a = {{bits, group, K, 0, N, w, scales, biases, sub, lut, NULL, high, top, sc16, mn16}, M,
                      slice > 0 ? slice : 1, h, h16, y, 0, 0};
    parallel(dq_gemm_task, &a, nth);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------------------------
 * One decoder layer of a batch of rows (decode steps, small chunks), as the model's forward runs it op by op:
 * RMSNorm + qkv, RoPE and the KV write, attention, o, RMSNorm + gate/up, act * up + down; the residual adds in
 * the norms. One call where the forward makes six, for the plain Llama layer (localpd.model decides when). */
typedef struct {
    int bits;
    const void *w;
    const uint16_t *scales, *biases;
    const uint8_t *sub; /* int4-k (gemm_args) */
    int group, N, K;
    const float *bias;
    const int8_t *lut; /* a codebook weight (gemm_args) */
    const uint8_t *high; /* a 5-bit weight's fifth bits (gemm_args) */
    const uint8_t *top;  /* Q6_K's upper bits, with sc16 its sub-block scales (gemm_args) */
    const int8_t *sc16;
    const int8_t *mn16; /* Q2_K's minima (gemm_args) */
} lin_plan;

#define QKV_PARTS 3
typedef struct {
    int n_heads, n_kv, head_dim, act;
    float eps;
    const float *attn_norm, *mlp_norm;
    lin_plan qkv, o, gate_up, down;
    /* qkv in up to QKV_PARTS weights of different formats (a GGUF's Q4_K q and k beside a Q6_K v), their outputs
     * side by side in qkv's columns: qkv is the first, more[i] the (i + 2)-th, `parts` in all */
    int parts;
    lin_plan more[QKV_PARTS - 1];
} layer_plan;

typedef struct {
    kv_side k, v; /* the layer's keys and values */
    int window;   /* sliding window (0: none) */
    int rope;     /* 0: the step's cos/sin, 1: the local ones (sliding-window layers), 2: no rotation */
} layer_cache;

/* Threads that meet between a step's phases without leaving the parallel region: each arrival counts, the last
 * one starts the next generation, the others spin on it, and after BARRIER_SPINS pauses (a few hundred
 * microseconds: longer than a phase of a decode step) sleep on it (a futex on Linux), so that a thread of the team
 * that another process has taken the core from gets it back. Not sched_yield: that hands the core to whatever else
 * is runnable, however low its priority, for a whole time slice, and a busy machine's decode then ran 4x slower
 * than on one thread. Starting a region costs tens of microseconds where the runtime's workers sleep (more threads
 * than cores: the engine thread's team beside the main thread's); a meeting here costs a cache line. */
#define BARRIER_SPINS 20000
typedef struct {
    atomic_int arrived;
    atomic_uint generation;
    atomic_int sleeping; /* waiters asleep on generation */
    atomic_int work; /* the next phase's shared counter (attn_args.next): zero again at each meeting */
} spin_barrier;

#if defined(__linux__)
static void generation_sleep(atomic_uint *g, unsigned seen) {
    syscall(SYS_futex, (unsigned *)g, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0); /* returns at once if it moved */
}
static void generation_wake(atomic_uint *g) {
    syscall(SYS_futex, (unsigned *)g, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
}
#else
static void generation_sleep(atomic_uint *g, unsigned seen) { (void)g, (void)seen, sched_yield(); }
static void generation_wake(atomic_uint *g) { (void)g; }
#endif

static void barrier_wait(spin_barrier *b, int nth) {
    if (nth <= 1) {
        atomic_store_explicit(&b->work, 0, memory_order_relaxed);
        return;
    }
    unsigned g = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->work, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&b->sleeping, memory_order_seq_cst)) generation_wake(&b->generation);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == g; spins++) {
        if (spins < BARRIER_SPINS) {
            cpu_relax();
            continue;
        }
        atomic_fetch_add_explicit(&b->sleeping, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&b->generation, memory_order_seq_cst) == g) generation_sleep(&b->generation, g);
        atomic_fetch_sub_explicit(&b->sleeping, 1, memory_order_relaxed);
    }
}

typedef struct {
    const layer_plan *plans;
    const layer_cache *caches;
    int n_layers, has_residual, T, B, PS;
    float *out, *x, *qkv, *attn, *gate_up;
    float *x2; /* the residual stream between a layer's two norms */
    const float *cos[2], *sin[2];
    long cs_t, pt_stride;
    const int64_t *slots, *stage_slots;
    const int32_t *page_table, *seq_lens, *q_starts;
    int *row_seq;
    float *part; /* attention's partial results (attn_args.part), sized for the most parts any layer takes */
    float scale;
    int8_t *xq; /* the rounded input of the product at hand: 2 M Kmax bytes, then its block scales and sums */
    float *xd;
    int32_t *xsum;
    spin_barrier barrier;
    int groups; /* the rows' groups (row_groups: their first rows follow row_seq) */
    int *one_row; /* each row its own group (own_pages' steps over int4ch pages): their first rows */
    float *piece; /* a qkv part's output rows (layer_plan.parts > 1), copied into qkv's columns */
} layers_args;

/* One product inside the layers' region: the input step (rows shared), everyone meets, the rows of the weight
 * shared, everyone meets. */
static void linear_phase(layers_args *s, int ith, int nth, int pre, const lin_plan *l, const float *x,
                         const float *residual, const float *norm_w, float eps, float *sum_out, float *y) {
    int M = s->T;
    input_args in = {pre, M, l->K, deinterleaved(l->bits, l->lut), x, residual, norm_w, eps, sum_out, s->xq, s->xd,
                     s->xsum};
    input_task(&in, ith, nth);
    barrier_wait(&s->barrier, nth);
    gemm_args g = {M, l->N, l->K, l->group, l->bits, s->xq, (size_t)M * l->K, s->xd, s->xsum, NULL, NULL, l->w,
                   l->scales, l->biases, l->sub, l->lut, l->bias, y}; /* equal shares: measured faster than
                                                                          * taking chunks from a counter */
    g.high = l->high, g.top = l->top, g.sc16 = l->sc16, g.mn16 = l->mn16;
    gemm_task(&g, ith, nth);
    barrier_wait(&s->barrier, nth);
}

static void layers_task(void *ctx, int ith, int nth) {
    layers_args *s = ctx;
    int T = s->T;
    for (int li = 0; li < s->n_layers; li++) {
        const layer_plan *L = &s->plans[li];
        const layer_cache *c = &s->caches[li];
        int D = L->head_dim, Hq = L->n_heads, H = L->n_kv, r = c->rope == 1;
        long row = (long)(Hq + 2 * H) * D;
        /* the residual stream goes x -> x2 in the first norm and back in the second (input_cols' sum_out) */
        const float *residual = li > 0 || s->has_residual ? s->x : NULL;
        if (L->parts == 1) {
            linear_phase(s, ith, nth, PRE_NORM, &L->qkv, s->out, residual, L->attn_norm, L->eps, s->x2, s->qkv);
        } else { /* each part its own product (its own input layout), its rows then copied into qkv's columns */
            long width = (long)(Hq + 2 * H) * D;
            int col = 0;
            for (int p = 0; p < L->parts; p++) {
                const lin_plan *l = p ? &L->more[p - 1] : &L->qkv;
                linear_phase(s, ith, nth, PRE_NORM, l, s->out, residual, L->attn_norm, L->eps, s->x2, s->piece);
                int t0, t1;
                share(T, ith, nth, &t0, &t1);
                for (int t = t0; t < t1; t++)
                    memcpy(s->qkv + t * width + col, s->piece + (size_t)t * l->N, sizeof(float) * l->N);
                col += l->N;
                barrier_wait(&s->barrier, nth);
            }
        }
        int t0, t1, per_page = c->k.fmt == KV_I4CH || c->v.fmt == KV_I4CH;
        share(T, ith, nth, &t0, &t1);
        if (per_page) t0 = 0, t1 = ith ? 0 : T; /* a page's rows rounded in turn: one thread writes them all */
        rope_rows(s->qkv, row, t0, t1, Hq, H, D, s->cos[r], s->sin[r], s->cs_t, c->rope != 2, s->slots,
                  s->stage_slots, (kv_side *)&c->k, (kv_side *)&c->v); /* the plan holds the pages const */
        barrier_wait(&s->barrier, nth);
        attn_shape shape = attention_shape(s->groups, Hq, H, nth,
                                           shortest_row(s->B, s->seq_lens, s->q_starts, c->window));
        int own = own_pages(&c->k, &c->v, s->stage_slots, s->B, s->q_starts);
        attn_args a = {s->qkv, row, D, T, Hq, D, H, s->PS, s->B, c->window, &c->k, &c->v, s->page_table,
                       s->seq_lens, s->q_starts, s->pt_stride, s->scale, s->attn, s->row_seq,
                       own ? s->one_row : s->row_seq + T, own ? T : s->groups, shape.per, shape.splits, s->part,
                       &s->barrier.work, own ? s->stage_slots : NULL};
        attention_task(&a, ith, nth);
        barrier_wait(&s->barrier, nth);
        if (shape.splits > 1) {
            merge_task(&a, ith, nth);
            barrier_wait(&s->barrier, nth);
        }
        linear_phase(s, ith, nth, PRE_NONE, &L->o, s->attn, NULL, NULL, 0.f, NULL, s->out);
        linear_phase(s, ith, nth, PRE_NORM, &L->gate_up, s->out, s->x2, L->mlp_norm, L->eps, s->x, s->gate_up);
        linear_phase(s, ith, nth, L->act, &L->down, s->gate_up, NULL, NULL, 0.f, NULL, s->out);
    }
}

/* n_layers decoder layers of a batch of rows (decode steps, small chunks) in one parallel region, as the model's
 * forward runs them op by op: RMSNorm + qkv, RoPE and the KV write, attention, o, RMSNorm + gate/up, act * up +
 * down, the residual adds in the norms; the same kernels in the same order, so the same floats. out [T, dim]: the
 * last sublayer's output, in and out; x [T, dim]: the residual stream (in only when has_residual, else it starts
 * as out); qkv, attn, gate_up: scratch rows of the projections' widths (every layer's the same); cos, sin [2]: the
 * step's rotations [T, D/2] (row stride cs_t) and the sliding-window layers' (layer_cache.rope); stage_slots: the
 * rows' stage slots over int4ch pages (else NULL). Returns 0, -1 without memory, -2 where the tables leave the
 * pool. */
int lpd_decode_layers(const layer_plan *plans, const layer_cache *caches, int n_layers, float *out, float *x,
                      int has_residual, int T, float *qkv, float *attn, float *gate_up, const float *const *cos,
                      const float *const *sin, long cs_t, const int64_t *slots, const int64_t *stage_slots, int PS,
                      const int32_t *page_table, long pt_stride, int pt_width, int n_pages, const int32_t *seq_lens,
                      const int32_t *q_starts, int B, float scale, int nth) {
    if (T <= 0 || n_layers <= 0) return 0;
    if (check_tables(T, B, seq_lens, q_starts, page_table, pt_stride, pt_width, n_pages, PS, slots)) return -2;
    for (int li = 0; li < n_layers; li++)
        if (check_stage(T, PS, slots, stage_slots, &caches[li].k, &caches[li].v)) return -2;
    int kmax = 0, heads = 0; /* the widest product input, and the most floats a row's attention outputs take */
    size_t piece = 0; /* the widest qkv part's outputs */
    for (int li = 0; li < n_layers; li++) {
        const lin_plan *ls[4] = {&plans[li].qkv, &plans[li].o, &plans[li].gate_up, &plans[li].down};
        for (int j = 0; j < 4; j++) kmax = ls[j]->K > kmax ? ls[j]->K : kmax;
        for (int p = 0; plans[li].parts > 1 && p < plans[li].parts; p++) {
            size_t w = (size_t)(p ? plans[li].more[p - 1].N : plans[li].qkv.N);
            piece = w > piece ? w : piece;
        }
        int h = plans[li].n_heads * (plans[li].head_dim + 2);
        heads = h > heads ? h : heads;
    }
    /* scratch, each piece 64-byte aligned: the residual stream's second buffer, the rounded input (two int8 levels,
     * block scales, block sums), attention's parts (at most 2 nth a row: attention_shape), each row's sequence, each
     * group's first row, each row's as a group of its own (own_pages), and a qkv part's outputs */
    size_t sizes[7] = {sizeof(float) * T * plans[0].qkv.K, 2 * (size_t)T * kmax, sizeof(float) * T * (kmax / 32),
                       sizeof(int32_t) * T * (kmax / 32), sizeof(float) * T * heads * 2 * (nth > 1 ? nth : 1),
                       sizeof(int) * (3 * (size_t)T + 2), sizeof(float) * T * piece};
    size_t at[7], total = 0;
    for (int i = 0; i < 7; i++) {
        at[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    static __thread void *buf;
    static __thread size_t cap;
    char *mem = scratch(&buf, &cap, total);
    if (!mem) return -1;
    layers_args s = {plans, caches, n_layers, has_residual, T, B, PS, out, x, qkv, attn, gate_up, (float *)mem,
                     {cos[0], cos[1]}, {sin[0], sin[1]}, cs_t, pt_stride, slots, stage_slots, page_table, seq_lens,
                     q_starts,
                     (int *)(mem + at[5]), (float *)(mem + at[4]), scale, (int8_t *)(mem + at[1]),
                     (float *)(mem + at[2]), (int32_t *)(mem + at[3])};
    atomic_init(&s.barrier.arrived, 0);
    atomic_init(&s.barrier.generation, 0);
    atomic_init(&s.barrier.sleeping, 0);
    atomic_init(&s.barrier.work, 0);
    s.one_row = s.row_seq + 2 * T + 1;
    s.piece = (float *)(mem + at[6]);
    row_groups(B, q_starts, s.row_seq, s.one_row, 1);
    s.groups = row_groups(B, q_starts, s.row_seq, s.row_seq + T, GROUP_ROWS);
    parallel(layers_task, &s, nth);
    return 0;
}

/* lpd_linear's input step and rounding, back in float: out [M, K] = the rows it would multiply (its two int8
 * levels times their scale), computed by the same code, so that a prefill's float GEMM multiplies exactly what a
 * decode step's int8 products do and a row's product does not depend on how many rows share its step. */
typedef struct {
    input_args in;
    float *out;
} round_args;

static void round_task(void *ctx, int ith, int nth) {
    const round_args *r = ctx;
    const input_args *a = &r->in;
    int lo, hi, K = a->K, nb = K / 32, xw = a->pre >= PRE_SILU ? 2 * K : K;
    share(a->M, ith, nth, &lo, &hi);
    static __thread void *buf;
    static __thread size_t cap;
    float *h = scratch(&buf, &cap, sizeof(float) * (size_t)K + 2 * (size_t)K + (sizeof(float) + sizeof(int32_t)) * nb);
    if (!h) return;
    int8_t *q = (int8_t *)(h + K);
    float *d = (float *)(q + 2 * K);
    int32_t *isum = (int32_t *)(d + nb);
    for (int m = lo; m < hi; m++) {
        const float *xm = a->x + (size_t)m * xw, *res = a->residual ? a->residual + (size_t)m * K : NULL;
        float rn = a->pre == PRE_NORM ? norm_factor(xm, res, K, a->eps) : 0.f;
        input_cols(a->pre, xm, res, a->norm_w, rn, a->sum_out ? a->sum_out + (size_t)m * K : NULL, K, 0, K, h);
        quantize_blocks(h, 0, nb, 0, q, q + K, d, isum);
        float *row = r->out + (size_t)m * K;
        for (int k = 0; k < K; k++) row[k] = (float)(256 * (int)q[k] + (int)q[K + k]) * d[k / 32];
    }
}

void lpd_round_input(int pre, const float *x, const float *residual, const float *norm_w, float eps, float *sum_out,
                     int M, int K, float *out, int nth) {
    round_args a = {{pre, M, K, 0, x, residual, norm_w, eps, sum_out, NULL, NULL, NULL}, out};
    parallel(round_task, &a, nth);
}
