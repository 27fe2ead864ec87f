/* The 4-bit CPU kernels: fp4.py's encode_2d / decode_2d in one pass over memory, bit for bit (tests/unit/test_fp4.py).
 *
 * Every step mirrors the torch reference, operation by operation, in fp32: built with -ffp-contract=off (no fused
 * multiply-adds) and no fast-math, so each product, quotient and sum rounds exactly as torch's does. Scale and
 * value tables come from the reference itself (fp4_native.py passes them in), so decoding cannot drift from it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The build records which source it came from (fp4_native.py refuses a library built from another fp4_cpu.c: a
 * stale in-place build after an edit would otherwise give other bits). */
#ifndef FP8COMM_SRC_SHA
#define FP8COMM_SRC_SHA "unknown"
#endif
const char *fp4_source_sha(void) { return FP8COMM_SRC_SHA; }

/* Built for any machine of the platform (wheels and images get copied: no -march=native). On x86-64 Linux with
 * GCC >= 12 the two hot entry points also get x86-64-v3 (AVX2) and x86-64-v4 (AVX-512) clones, picked at load time
 * by the CPU's features (measured, docs/fp4.md: fp32 encode as fast as a -march=native build, bf16 encode ~25%
 * slower, decode and sum at parity); the arithmetic is the same
 * fp32 operations in the same order (no contraction: -ffp-contract=off), so every clone gives the same bits. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 \
    && !defined(FP8COMM_NO_CLONES)
#define FP8COMM_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define FP8COMM_CLONES
#endif

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float pow2i(int e) { return u2f((uint32_t)(e + 127) << 23); } /* e in [-126, 127] */
static inline int exp_bits(float a) { return (int)((f2u(a) >> 23) & 0xFF) - 127; }
static inline int is_fin(float v) { return (f2u(v) & 0x7F800000u) != 0x7F800000u; }

static inline uint32_t mix32(uint32_t x) { /* reference.mix32 (lowbias32) */
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

/* fp4.pow2_exponent: smallest E with amax / 2**E <= limit = fm * 2**fk (frexp form); 0 for amax == 0 */
static inline int pow2_exponent(float amax, float fm, int fk) {
    if (!(amax > 0.0f)) return 0;
    int k;
    float m = frexpf(amax, &k);
    int e = k - fk + (m > fm);
    return e < -126 ? -126 : (e > 126 ? 126 : e);
}

/* fp4.e4m3_ceil: the smallest E4M3 s with 6 s >= a (capped at 448), and its code */
static inline float e4m3_ceil(float a, int *code) {
    float r = a / 6.0f;
    if (r > 448.0f) r = 448.0f;
    int sp = exp_bits(r) - 3;
    if (sp < -9) sp = -9;
    float q = ceilf(r * pow2i(-sp));
    float s = q * pow2i(sp);
    if (s * 6.0f < a && r < 448.0f) q += 1.0f;
    s = q * pow2i(sp);
    *code = ((sp + 9) << 3) + (int)q;
    return s;
}

/* fp4.round_e2m1 of finite y with the sign of xf; u < 0 means nearest-even */
static inline uint32_t round_e2m1(float y, uint32_t neg, float u) {
    float a = fabsf(y);
    if (a > 6.0f) a = 6.0f;
    int sp = exp_bits(a) - 1;
    if (sp < -1) sp = -1;
    float r = a * pow2i(-sp);
    float q;
    if (u < 0.0f) {
        q = rintf(r); /* the default rounding mode: half to even, as torch.round */
    } else {
        float i = floorf(r);
        q = i + (u < r - i ? 1.0f : 0.0f);
    }
    return (uint32_t)((((sp + 1) << 1) + (int)q)) | (neg << 3);
}

/* The codes of one block (bsz <= 32 finite-masked values xf): y = xf * mul (MXFP4) or (xf * mul) / div (NVFP4),
 * rounded to nearest-even, or up in magnitude when u[j] < frac (u == NULL: nearest). Written for constant nv and
 * u-presence after inlining, so each of the four variants vectorizes. */
static inline void block_codes(const float *xf, int64_t bsz, int nv, float mul, float div, const float *u,
                               uint8_t *c) {
    for (int64_t j = 0; j < bsz; j++) {
        float v = xf[j];
        float y = nv ? (v * mul) / div : v * mul;
        c[j] = (uint8_t)round_e2m1(y, f2u(v) >> 31, u ? u[j] : -1.0f);
    }
}

/* Encode x [m, k] (row stride ldx elements; fp32, or bf16 when bf) into codes [m, k/2] and scale bytes
 * [m, k/block], both contiguous. nv = 0: MXFP4 (block 32, E8M0). nv = 1: NVFP4 (block 16, E4M3) relative to a power-of-two scale per row taken
 * from ta[i * ta_step] (ta_step 0: one value for every row), or from the row's own finite amax when ta is NULL;
 * tscale[i] receives that scale. sr: stochastic rounding with uniforms from (key, index_base + i * k + j).
 * counters (or NULL) += [finite non-zero elements encoded as +-0, non-finite elements]. */
FP8COMM_CLONES
void fp4_encode(const void *x, int bf, int64_t m, int64_t k, int64_t ldx, int nv, const float *ta, int64_t ta_step,
                int sr, uint32_t key, int64_t index_base, uint8_t *codes, uint8_t *sbytes, float *tscale,
                int64_t *counters) {
    const int64_t bsz = nv ? 16 : 32, nb = k / bsz;
    int64_t flushed = 0, nonfinite = 0;
    float xf[32], u[32], wide[32];
    uint8_t c[32];
    for (int64_t i = 0; i < m; i++) {
        const float *xr = (const float *)x + i * ldx;
        const uint16_t *hr = (const uint16_t *)x + i * ldx;
        float pg = 1.0f;
        if (nv) {
            float t;
            if (ta) {
                t = ta[i * ta_step];
            } else {
                t = 0.0f;
                for (int64_t j = 0; j < k; j++) {
                    float v = bf ? u2f((uint32_t)hr[j] << 16) : xr[j], av = is_fin(v) ? fabsf(v) : 0.0f;
                    t = av > t ? av : t;
                }
            }
            int g = pow2_exponent(t, 0.65625f, 12); /* NV_TENSOR_MAX = 2688 = 0.65625 * 2**12 */
            pg = pow2i(-g);
            tscale[i] = pow2i(g);
        }
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + b * bsz;
            if (bf) { /* bf16 widened exactly (torch's .float()), a block at a time */
                for (int64_t j = 0; j < bsz; j++) wide[j] = u2f((uint32_t)hr[b * bsz + j] << 16);
                xb = wide;
            }
            float amax = 0.0f;
            int bad = 0;
            for (int64_t j = 0; j < bsz; j++) {
                float v = xb[j];
                int f = is_fin(v);
                bad |= !f;
                xf[j] = f ? v : 0.0f;
                float av = fabsf(xf[j]);
                amax = av > amax ? av : amax;
            }
            float mul, div = 1.0f;
            int sbyte;
            if (nv) {
                int code;
                float s = e4m3_ceil(amax * pg, &code);
                mul = pg;
                div = s > 0.0f ? s : 1.0f;
                sbyte = bad ? 0x7F : code;
            } else {
                int e = pow2_exponent(amax, 0.75f, 3); /* E2M1_MAX = 6 = 0.75 * 2**3 */
                mul = pow2i(-e);
                sbyte = bad ? 0xFF : e + 127;
            }
            sbytes[i * nb + b] = (uint8_t)sbyte;
            if (sr) {
                uint32_t base = (uint32_t)((uint64_t)(index_base + i * k + b * bsz) & 0xFFFFFFFFu);
                for (int64_t j = 0; j < bsz; j++)
                    u[j] = (float)(int32_t)(mix32((base + (uint32_t)j) ^ key) >> 8) * 0x1p-24f;
            }
            if (nv && sr)
                block_codes(xf, 16, 1, mul, div, u, c);
            else if (nv)
                block_codes(xf, 16, 1, mul, div, 0, c);
            else if (sr)
                block_codes(xf, 32, 0, mul, div, u, c);
            else
                block_codes(xf, 32, 0, mul, div, 0, c);
            uint8_t *cb = codes + i * (k / 2) + b * (bsz / 2);
            for (int64_t j = 0; j < bsz / 2; j++) cb[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
            if (counters) {
                int32_t fl = 0;
                for (int64_t j = 0; j < bsz; j++) fl += xf[j] != 0.0f && (c[j] & 7) == 0;
                flushed += fl; /* xf is 0 at the non-finite lanes: they are counted once, below */
                if (bad)
                    for (int64_t j = 0; j < bsz; j++) nonfinite += !is_fin(xb[j]);
            }
        }
    }
    if (counters) {
        counters[0] += flushed;
        counters[1] += nonfinite;
    }
}

/* Decode n chunks of `rows` x k (codes[c] [rows, k/2], sbytes[c] [rows, k/block], tscale[c] one fp32 or NULL)
 * into out [rows, k] (row stride ldo, first `cols` columns written):
 * mode 0: chunk c into rows c * rows .. (out holds n * rows rows); mode 1: the sum of the chunks in chunk order
 * (acc = d0; acc += d1; ...). mode 2: out = x - decode (x row stride ldo too), non-finite differences -> 0: the
 * error-feedback residual (n == 1). vals: the 16 E2M1 values; scales: the 256 scale-byte values. */
FP8COMM_CLONES
void fp4_decode(const uint8_t *const *codes, const uint8_t *const *sbytes, const float *const *tscale, int64_t n,
                int64_t rows, int64_t k, int64_t cols, int nv, const float *vals, const float *scales, int mode,
                const float *x, float *out, int64_t ldo) {
    const int64_t bsz = nv ? 16 : 32, nb = k / bsz;
    float tile[32];
    for (int64_t c = 0; c < (mode == 1 ? 1 : n); c++) {
        for (int64_t i = 0; i < rows; i++) {
            float *o = out + (mode == 0 ? c * rows + i : i) * ldo;
            const float *xr = x ? x + i * ldo : 0;
            for (int64_t b = 0; b < nb && b * bsz < cols; b++) {
                int64_t w = cols - b * bsz < bsz ? cols - b * bsz : bsz;
                for (int64_t cc = (mode == 1 ? 0 : c); cc < (mode == 1 ? n : c + 1); cc++) {
                    const uint8_t *cb = codes[cc] + i * (k / 2) + b * (bsz / 2);
                    float s = scales[sbytes[cc][i * nb + b]];
                    float ts = nv ? tscale[cc][0] : 1.0f;
                    for (int64_t j = 0; j < bsz; j += 2) {
                        uint8_t byte = cb[j / 2];
                        float d0 = vals[byte & 15] * s, d1 = vals[byte >> 4] * s;
                        if (nv) {
                            d0 = d0 * ts;
                            d1 = d1 * ts;
                        }
                        if (cc == 0 || mode != 1) {
                            tile[j] = d0;
                            tile[j + 1] = d1;
                        } else {
                            tile[j] = tile[j] + d0;
                            tile[j + 1] = tile[j + 1] + d1;
                        }
                    }
                }
                float *ob = o + b * bsz;
                if (mode == 2) {
                    const float *xb = xr + b * bsz;
                    for (int64_t j = 0; j < w; j++) {
                        float r = xb[j] - tile[j];
                        ob[j] = is_fin(r) ? r : 0.0f;
                    }
                } else {
                    memcpy(ob, tile, (size_t)w * sizeof(float));
                }
            }
        }
    }
}

/* bf16(float(r) + d): the fp32 sum rounded once to bf16, to nearest even; NaN -> 0xFFFF (what torch's CPU
 * float -> bfloat16 conversion writes, so the bits equal `r.copy_(r.float().add_(d))`). */
static inline uint16_t add_bf16(uint16_t r, float d) {
    uint32_t u = f2u(u2f((uint32_t)r << 16) + d);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp4_decode's mode 0 for ONE chunk of `rows` x k, added into a bf16 out [rows, cols] (row stride ldo, first
 * `cols` columns): out = add_bf16(out, decoded), each block decoded into a tile exactly as fp4_decode does, then
 * added. The replica update's decode and add in one pass: the fp32 decode never leaves the tile. */
FP8COMM_CLONES
void fp4_decode_add_bf16(const uint8_t *codes, const uint8_t *sbytes, const float *tscale, int64_t rows, int64_t k,
                         int64_t cols, int nv, const float *vals, const float *scales, uint16_t *out, int64_t ldo) {
    const int64_t bsz = nv ? 16 : 32, nb = k / bsz;
    const float ts = nv ? tscale[0] : 1.0f;
    float tile[32];
    for (int64_t i = 0; i < rows; i++) {
        uint16_t *o = out + i * ldo;
        for (int64_t b = 0; b < nb && b * bsz < cols; b++) {
            const int64_t w = cols - b * bsz < bsz ? cols - b * bsz : bsz;
            const uint8_t *cb = codes + i * (k / 2) + b * (bsz / 2);
            const float s = scales[sbytes[i * nb + b]];
            for (int64_t j = 0; j < bsz; j += 2) {
                const uint8_t byte = cb[j / 2];
                tile[j] = vals[byte & 15] * s;
                tile[j + 1] = vals[byte >> 4] * s;
            }
            if (nv)
                for (int64_t j = 0; j < bsz; j++) tile[j] = tile[j] * ts;
            uint16_t *ob = o + b * bsz;
            for (int64_t j = 0; j < w; j++) ob[j] = add_bf16(ob[j], tile[j]);
        }
    }
}
