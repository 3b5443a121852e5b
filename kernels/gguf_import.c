/* GGUF blocks -> localpd's weight fields, straight from the file's mapped bytes (localpd/load/gguf_import.py builds
 * this file as kernels/cpu.py builds cpu_kernels.c, and calls it with ctypes).
 *
 * lpd_import(type, src, n, k, order, out) reads the n rows of a tensor of `type` (TYPES below; k columns, its
 * blocks running along a row) from `src` and writes each output row r from source row order[r] (order NULL: row r)
 * into the fields `out` points to, in the order the weight's dataclass lists them (quant/weights.py, int4k.py,
 * int5.py, int6k.py), each row-major. The fields are the torch imports' (quant.weights.from_gguf) bit for bit:
 * codes as Int4Weight's nibbles (column 2b in byte b's low half), a fifth bit as quant/int5.py's `fifth` (a
 * block's even columns, then its odd ones, eight blocks a group), Q6_K's two upper bits as quant/int6k.py's
 * `upper`, a codebook's as quant/codebook.py packs them, float16 fields copied as their bits, those computed
 * (Q4_0's -8 d, Q5_0's -16 d, IQ4_XS's d (ls - 32), MXFP4's 2^(e - 128)) rounded as torch rounds to float16.
 * Returns 0, or 1 where a float16 scale or bias is not finite: the caller then takes the torch import, which names
 * the value. */

#include <stdint.h>
#include <string.h>

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, Q2_K };

/* The low four bits of a block's 32 codes as the nibbles of 16 bytes. */
static void put_nibbles(uint8_t *dst, const uint8_t *q) {
    for (int b = 0; b < 16; b++) dst[b] = (uint8_t)((q[2 * b] & 15) | (q[2 * b + 1] << 4));
}

/* Bit `bit` of a block's 32 codes as 4 bytes: bit e of the little-endian word is code 2e's for e < 16, code
 * 2(e - 16) + 1's for the rest. */
static void put_plane(uint8_t *dst, const uint8_t *q, int bit) {
    uint32_t w = 0;
    for (int e = 0; e < 16; e++) w |= (uint32_t)((q[2 * e] >> bit) & 1) << e;
    for (int e = 0; e < 16; e++) w |= (uint32_t)((q[2 * e + 1] >> bit) & 1) << (16 + e);
    memcpy(dst, &w, 4);
}

/* The fifth bits of a block's 32 codes as block j of a group of eight in quant/int5.py's `fifth`: bit j of the
 * group's 32 bytes, byte e position e's (put_plane's order); j == 0 writes the bytes, the rest add their bit. */
static void put_fifth(uint8_t *group, const uint8_t *q, int j) {
    for (int e = 0; e < 32; e++) {
        uint8_t bit = (uint8_t)(((q[e < 16 ? 2 * e : 2 * (e - 16) + 1] >> 4) & 1) << j);
        group[e] = j ? (uint8_t)(group[e] | bit) : bit;
    }
}

/* Block b of a row's fifth bits where `fifth` holds them (quant/int5.py): bit b % 8 of its group's 32 bytes, or,
 * past the row's last eight blocks, 4 bytes of its own. */
static void put_fifth_of(uint8_t *row, const uint8_t *q, int64_t k, int64_t b) {
    if (b < k / 256 * 8) put_fifth(row + 32 * (b / 8), q, (int)(b % 8));
    else put_plane(row + 4 * b, q, 4);
}

/* The two upper bits of four blocks' 128 codes (q >> 4) as quant/int6k.py's `upper` holds them: 32 bytes, byte e's
 * bits 2j, 2j + 1 block j's position e (put_plane's order: code 2e for e < 16, code 2(e - 16) + 1 for the rest). */
static void put_upper(uint8_t *dst, const uint8_t *q) {
    for (int e = 0; e < 32; e++) {
        int c = e < 16 ? 2 * e : 2 * (e - 16) + 1;
        uint8_t v = 0;
        for (int j = 0; j < 4; j++) v |= (uint8_t)(((q[32 * j + c] >> 4) & 3) << (2 * j));
        dst[e] = v;
    }
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {  /* zero or subnormal: m 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = sign | ((e == 31 ? 255 : e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A float16 times 2^e (e > 0), exact where it fits; returns 0 where it does not (infinite, or already not finite). */
static int half_times_pow2(uint16_t h, int e, uint16_t *out) {
    uint16_t sign = h & 0x8000, mag = h & 0x7FFF;
    if ((mag >> 10) == 31) return 0;
    while (e > 0 && mag && (mag >> 10) == 0) {  /* subnormal: double the mantissa */
        mag <<= 1;
        e--;
    }
    if (mag && (mag >> 10) + e >= 31) return 0;
    if (mag) mag += (uint16_t)(e << 10);
    *out = sign | mag;
    return 1;
}

/* float -> float16 bits, rounded to the nearest (ties to even), as torch's .half(); 0 where it does not fit
 * (infinite or not a number). */
static int half_of(float f, uint16_t *out) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax >= 0x477FF000) return 0;  /* 65520 and up round to infinity */
    if (ax >= 0x38800000) {  /* normal: rebias the exponent, round the 13 bits dropped */
        *out = (uint16_t)(sign | ((ax - 0x38000000 + 0xFFF + ((ax >> 13) & 1)) >> 13));
        return 1;
    }
    int e = (int)(ax >> 23);
    if (e < 102) {  /* below 2^-25: zero */
        *out = (uint16_t)sign;
        return 1;
    }
    uint32_t m = (ax & 0x7FFFFF) | 0x800000, shift = (uint32_t)(126 - e), q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    *out = (uint16_t)(sign | q);
    return 1;
}

/* Whether the float16 at p is finite (the group-32 types' scales and biases must be, as the torch import holds). */
static int finite_half(const uint8_t *p) { return (p[1] & 0x7C) != 0x7C; }

/* Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins. */
static void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

typedef struct {
    int block, size;  /* columns and bytes a block */
} Kind;

static const Kind KINDS[] = {[Q8_0] = {32, 34}, [Q4_0] = {32, 18}, [Q4_1] = {32, 20}, [Q5_0] = {32, 22},
                             [Q5_1] = {32, 24}, [Q4_K] = {256, 144}, [Q5_K] = {256, 176}, [Q6_K] = {256, 210},
                             [Q3_K] = {256, 110}, [IQ4_NL] = {32, 18}, [IQ4_XS] = {256, 136}, [MXFP4] = {32, 17},
                             [Q2_K] = {256, 84}};

/* A codebook type's row (quant/codebook.py): each block's codes (MXFP4's 0 as 8, its other zero, as the torch import
 * maps the value 0) and float16 scale, then the codes packed a pair of blocks at a time (byte j: column j of the
 * first block low, of the second high; an odd last block as stored, columns j and j + 16). */
static int codebook_row(int type, const uint8_t *s, int64_t k, int64_t r, void **out) {
    int64_t g32 = k / 32;
    uint8_t *codes = (uint8_t *)out[0] + r * (k / 2);  /* the row's own bytes, written in place below */
    uint16_t *scales = (uint16_t *)out[1] + r * g32;
    uint8_t q[64];
    int ok = 1;
    for (int64_t b = 0; b < g32; b++) {
        const uint8_t *qs;
        if (type == IQ4_XS) {  /* 8 blocks of 32 a super-block: d (ls - 32), ls six bits */
            const uint8_t *sb = s + (b / 8) * 136;
            int j = (int)(b % 8), ls = ((sb[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sb[2 + j / 4] >> (2 * (j % 4))) & 3) << 4);
            uint16_t d;
            memcpy(&d, sb, 2);
            ok &= finite_half(sb) && half_of(half_to_float(d) * (float)(ls - 32), &scales[b]);
            qs = sb + 8 + 16 * j;
        } else if (type == IQ4_NL) {
            const uint8_t *blk = s + b * 18;
            ok &= finite_half(blk);
            memcpy(&scales[b], blk, 2);
            qs = blk + 2;
        } else {  /* MXFP4: 2^(e - 128), the codebook doubled */
            const uint8_t *blk = s + b * 17;
            uint32_t e = blk[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
            float f;
            memcpy(&f, &bits, 4);
            ok &= half_of(f, &scales[b]);
            qs = blk + 1;
        }
        uint8_t *half = q + 32 * (b % 2);
        for (int j = 0; j < 16; j++) {
            half[j] = qs[j] & 15;
            half[j + 16] = qs[j] >> 4;
        }
        if (type == MXFP4)
            for (int j = 0; j < 32; j++) half[j] = half[j] ? half[j] : 8;
        if (b % 2) {
            for (int j = 0; j < 32; j++) codes[32 * (b / 2) + j] = (uint8_t)(q[j] | (q[32 + j] << 4));
        } else if (b == g32 - 1) {
            for (int j = 0; j < 16; j++) codes[16 * b + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
        }
    }
    return ok;
}

/* One row of nb blocks -> row r of the fields. */
static int import_row(int type, const uint8_t *s, int64_t k, int64_t r, void **out) {
    if (type >= IQ4_NL && type <= MXFP4) return codebook_row(type, s, k, r, out);
    int64_t nb = k / KINDS[type].block, g32 = k / 32;
    uint8_t q[256];
    int ok = 1;
    for (int64_t b = 0; b < nb; b++, s += KINDS[type].size) {
        switch (type) {
        case Q8_0: {
            ok &= finite_half(s);
            memcpy((uint8_t *)out[0] + r * k + 32 * b, s + 2, 32);
            memcpy((uint16_t *)out[1] + r * g32 + b, s, 2);
            break;
        }
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
            int five = type == Q5_0 || type == Q5_1, with_min = type == Q4_1 || type == Q5_1;
            const uint8_t *qs = s + 2 + 2 * with_min + 4 * five;
            uint32_t qh = 0;
            if (five) memcpy(&qh, s + 2 + 2 * with_min, 4);
            for (int j = 0; j < 16; j++) {
                q[j] = (uint8_t)((qs[j] & 15) | (five ? ((qh >> j) & 1) << 4 : 0));
                q[j + 16] = (uint8_t)((qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0));
            }
            uint16_t d, bias;
            memcpy(&d, s, 2);
            ok &= finite_half(s) & (!with_min || finite_half(s + 2));
            if (with_min) memcpy(&bias, s + 2, 2);
            else if (!half_times_pow2(d ^ 0x8000, five ? 4 : 3, &bias)) ok = 0;  /* -8 d, -16 d */
            put_nibbles((uint8_t *)out[0] + r * (k / 2) + 16 * b, q);
            int f = 1;
            if (five) put_fifth_of((uint8_t *)out[f++] + r * (k / 8), q, k, b);
            ((uint16_t *)out[f])[r * g32 + b] = d;
            ((uint16_t *)out[f + 1])[r * g32 + b] = bias;
            break;
        }
        case Q4_K: case Q5_K: {
            int five = type == Q5_K;
            const uint8_t *qh = s + 16, *qs = s + 16 + 32 * five;
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    int hi0 = five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, hi1 = five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
                    q[64 * c + l] = (uint8_t)((qs[32 * c + l] & 15) | hi0);
                    q[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | hi1);
                }
            uint8_t sc[8], mn[8];
            k_scales(s + 4, sc, mn);
            int f = 1;
            for (int j = 0; j < 8; j++) {
                put_nibbles((uint8_t *)out[0] + r * (k / 2) + 128 * b + 16 * j, q + 32 * j);
                if (five) put_fifth((uint8_t *)out[1] + r * (k / 8) + 32 * b, q + 32 * j, j);
            }
            f += five;
            memcpy((uint16_t *)out[f] + r * nb + b, s, 2);
            memcpy((uint16_t *)out[f + 1] + r * nb + b, s + 2, 2);
            uint8_t *sub = (uint8_t *)out[f + 2] + r * 2 * g32;
            for (int j = 0; j < 8; j++) {
                sub[8 * b + j] = sc[j];
                sub[g32 + 8 * b + j] = (uint8_t)(-(int)mn[j]);
            }
            break;
        }
        case Q6_K: {
            const uint8_t *ql = s, *qh = s + 128;
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++)
                    for (int l = 0; l < 32; l++)
                        q[128 * h + 32 * i + l] = (uint8_t)(((ql[64 * h + l + 32 * (i % 2)] >> (4 * (i / 2))) & 15)
                                                            | (((qh[32 * h + l] >> (2 * i)) & 3) << 4));
            for (int j = 0; j < 8; j++) put_nibbles((uint8_t *)out[0] + r * (k / 2) + 128 * b + 16 * j, q + 32 * j);
            put_upper((uint8_t *)out[1] + r * (k / 4) + 64 * b, q);
            put_upper((uint8_t *)out[1] + r * (k / 4) + 64 * b + 32, q + 128);
            memcpy((uint16_t *)out[2] + r * nb + b, s + 208, 2);
            memcpy((int8_t *)out[3] + r * (k / 16) + 16 * b, s + 192, 16);
            break;
        }
        case Q3_K: {
            const uint8_t *hmask = s, *qs = s + 32, *sb = s + 96;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++)
                        q[128 * h + 32 * j + l] = (uint8_t)((((qs[32 * h + l] >> (2 * j)) & 3)
                                                             | (((hmask[l] >> (4 * h + j)) & 1) << 2)) + 4);
            for (int j = 0; j < 8; j++) put_nibbles((uint8_t *)out[0] + r * (k / 2) + 128 * b + 16 * j, q + 32 * j);
            memcpy((uint16_t *)out[1] + r * nb + b, s + 108, 2);
            int8_t *sc = (int8_t *)out[2] + r * (k / 16) + 16 * b;
            for (int i = 0; i < 8; i++) {
                int pick = i < 4 ? 0 : 2, hb = sb[8 + i % 4];
                sc[i] = (int8_t)(((sb[i] & 15) | (((hb >> pick) & 3) << 4)) - 32);
                sc[8 + i] = (int8_t)(((sb[i] >> 4) | (((hb >> (pick + 4)) & 3) << 4)) - 32);
            }
            break;
        }
        case Q2_K: {  /* 16 scale bytes (sc low, mn high), 64 of two-bit codes, d, dmin */
            const uint8_t *sb = s, *qs = s + 16;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) q[128 * h + 32 * j + l] = (uint8_t)((qs[32 * h + l] >> (2 * j)) & 3);
            for (int j = 0; j < 8; j++) put_nibbles((uint8_t *)out[0] + r * (k / 2) + 128 * b + 16 * j, q + 32 * j);
            memcpy((uint16_t *)out[1] + r * nb + b, s + 80, 2);
            memcpy((uint16_t *)out[2] + r * nb + b, s + 82, 2);
            int8_t *sc = (int8_t *)out[3] + r * (k / 16) + 16 * b, *mn = (int8_t *)out[4] + r * (k / 16) + 16 * b;
            for (int i = 0; i < 16; i++) {
                sc[i] = (int8_t)(sb[i] & 15);
                mn[i] = (int8_t)(sb[i] >> 4);
            }
            break;
        }
        }
    }
    return ok;
}

int lpd_import(int type, const uint8_t *src, int64_t n, int64_t k, const int64_t *order, void **out) {
    if (type < Q8_0 || type > Q2_K || k % KINDS[type].block) return 2;
    int64_t row_bytes = k / KINDS[type].block * KINDS[type].size;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t r = 0; r < n; r++)
        failed |= !import_row(type, src + (order ? order[r] : r) * row_bytes, k, r, out);
    return failed;
}
