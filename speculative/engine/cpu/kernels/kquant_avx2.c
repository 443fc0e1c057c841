// y = x W^T for GGUF-quantized weights W (Q4_K, Q6_K, Q8_0) at their stored precision, AVX2 (kquant_vnni.c's
// twin for CPUs without AVX-512: the same packed layout, the same entry points, the same integer sums).
//
// A target's decode step reads every weight once, so it costs the bytes it reads: these kernels read the weights
// as the GGUF file stores them (4.6, 6.6 and 8.5 bits a weight with their scales), never expanded. Each row of x
// is quantized to int8 per group of 32 inputs (scale = max |x| / 127), as kquant_vnni.c does, and the weights'
// codes u (unsigned bytes) multiply it with VPMADDUBSW (u8 x s8, two products summed into s16 per pair) and
// VPMADDWD (s16 pairs summed into s32): a 32-bit lane holds one output's sum over 4 inputs, as VPDPBUSD's does,
// so a 64-byte chunk of the layout is two registers (outputs 0-7 and 8-15 of the tile). The s16 sums never
// saturate: Q4_K sums 8 VPMADDUBSW results (8 x 2 x 15 x 127 < 32768) and Q6_K 2 (2 x 2 x 63 x 127) before they
// widen; Q8_0 multiplies |q| by x with q's sign (2 x 128 x 127), one VPMADDUBSW each.
//   Q4_K  sum w x = xs * (d * sc * sum u xq - dmin * m * sum xq)
//   Q6_K  sum w x = xs * d * sc * (sum u xq - 32 sum xq)
//   Q8_0  sum w x = xs * d * sum q xq
//   Q4_1  sum w x = xs * (d * sum u xq + m * sum xq)  (this kernel only: a draft's 4-bit groups)
// The integer sums are exact, and the float32 steps after them are kquant_vnni.c's in its order (fused
// multiply-adds as written, no others), so a row's outputs are the VNNI kernel's bits.
//
// Batch invariance by construction: each row's outputs are reduced alone, in the order of the inputs, the same
// for 1 row or 64, on one thread or several (threads split the outputs, never a sum).
//
// Layout: kquant_vnni.c's header (speculative/engine/cpu/kquant.py packs it).
#define KQUANT_Q4_1  // this kernel also takes Q4_1 (a draft's 4-bit weight groups, kquant.py's `from_grid`)
#include "kquant_common.h"  // first: it defines _GNU_SOURCE

#include <immintrin.h>

#define MAX_ROWS 8  // rows a tile takes at once: Q4_K unpacks a group once for 8 (2 accumulators a row spill)

typedef struct {
    __m256 v[2];  // a tile's 16 lanes: outputs 0-7, 8-15
} F16;

static inline F16 f16x16(const uint8_t* p) {
    F16 f = {{_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))}};
    return f;
}
static inline F16 u8x16(const uint8_t* p) {
    F16 f = {{_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))}};
    return f;
}
static inline F16 i8x16(const uint8_t* p) {
    F16 f = {{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))}};
    return f;
}
static inline F16 mul(F16 a, F16 b) {
    F16 f = {{_mm256_mul_ps(a.v[0], b.v[0]), _mm256_mul_ps(a.v[1], b.v[1])}};
    return f;
}
static inline __m256i four(const Rows* x, int r, int input) {  // 4 int8 of row r from `input`, in every lane
    int32_t v;
    memcpy(&v, x->xq + (size_t)r * x->I + input, 4);
    return _mm256_set1_epi32(v);
}
static inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }  // pairs -> s32
static inline void prefetch(const uint8_t* w, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char*)(w + PREFETCH + line), _MM_HINT_T0);
}

static inline F16 negated(F16 a) {  // exact: the sign bit flipped
    const __m256 sign = _mm256_set1_ps(-0.0f);
    F16 f = {{_mm256_xor_ps(a.v[0], sign), _mm256_xor_ps(a.v[1], sign)}};
    return f;
}

// A group g of 32 inputs as 4-bit codes u (4 chunks of 64 bytes from q: Q4_K's group, Q4_1's block) for rows
// r0 .. r0 + MR - 1: acc[r] += xs * (scale * sum u xq) + xs * (low * sum xq)  (Q4_K: low = -dmin * m; Q4_1: m)
static inline __attribute__((always_inline)) void four_bit_group(const uint8_t* q, F16 scale, F16 low, const Rows* x,
                                                                 int g, int r0, F16* acc, const int MR) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {  // outputs 8h .. 8h + 7
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            __m256i v = load(q + 64 * c + 32 * h);
            lo[c] = _mm256_and_si256(v, nibble);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < MR; r++) {
            __m256i s16 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[c], four(x, r0 + r, 32 * g + 8 * c)));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[c], four(x, r0 + r, 32 * g + 8 * c + 4)));
            }
            float xs = x->xs[(size_t)(r0 + r) * x->G + g];
            const int32_t* sums = x->sums + (size_t)(r0 + r) * 2 * x->G + 2 * g;
            __m256 dot = _mm256_cvtepi32_ps(widen(s16));
            __m256 a = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale.v[h], _mm256_set1_ps(xs)), acc[r].v[h]);
            acc[r].v[h] = _mm256_fmadd_ps(low.v[h], _mm256_set1_ps(xs * (float)(sums[0] + sums[1])), a);
        }
    }
}

// One tile's 16 outputs for rows r0 .. r0 + MR - 1 (MR a constant at each call site): acc[r] += their sums
static inline __attribute__((always_inline)) void q4_k(const uint8_t* w, const Rows* x, int r0, F16* acc,
                                                       const int MR) {
    for (int s = 0; s < x->I / 256; s++, w += Q4_K_BYTES) {
        F16 d = f16x16(w), dmin = f16x16(w + 32);
        for (int j = 0; j < 8; j++) {
            int g = 8 * s + j;
            prefetch(w + j * (Q4_K_BYTES / 8), Q4_K_BYTES / 8);
            const uint8_t* q = w + 320 + 256 * j;
            F16 scale = mul(d, u8x16(w + 64 + 16 * j)), low = mul(dmin, u8x16(w + 192 + 16 * j));
            four_bit_group(q, scale, negated(low), x, g, r0, acc, MR);
        }
    }
}

// Q4_1 (GGML's layout per 32 inputs: d and m fp16, 16 bytes of nibbles; here per tile d[16], m[16], then the 4
// chunks of Q4_K's group): w = d * u + m, so sum w x = xs * (d * sum u xq + m * sum xq)
static inline __attribute__((always_inline)) void q4_1(const uint8_t* w, const Rows* x, int r0, F16* acc,
                                                       const int MR) {
    for (int g = 0; g < x->G; g++, w += Q4_1_BYTES) {
        prefetch(w, Q4_1_BYTES);
        F16 d = f16x16(w), m = f16x16(w + 32);
        four_bit_group(w + 64, d, m, x, g, r0, acc, MR);
    }
}

static inline __attribute__((always_inline)) void q6_k(const uint8_t* w, const Rows* x, int r0, F16* acc,
                                                       const int MR) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    for (int s = 0; s < x->I / 256; s++, w += Q6_K_BYTES) {
        F16 d = f16x16(w);
        for (int j = 0; j < 8; j++) {
            int g = 8 * s + j;
            prefetch(w + j * (Q6_K_BYTES / 8), Q6_K_BYTES / 8);
            const uint8_t* q = w + 288 + 384 * j;
            F16 scale[2] = {mul(d, i8x16(w + 32 + 32 * j)), mul(d, i8x16(w + 48 + 32 * j))};
            __m256i part[2][2][MAX_ROWS];  // per 16 inputs h, outputs 8l .. 8l + 7 and row: sum u xq
            for (int h = 0; h < 2; h++) {
                for (int l = 0; l < 2; l++) {
                    __m256i bits = load(q + 256 + 64 * h + 32 * l);
                    __m256i v0 = load(q + 128 * h + 32 * l), v1 = load(q + 128 * h + 64 + 32 * l);
                    __m256i u[4] = {
                        _mm256_or_si256(_mm256_and_si256(v0, nibble), _mm256_and_si256(_mm256_slli_epi16(bits, 4), high)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
                                        _mm256_and_si256(_mm256_slli_epi16(bits, 2), high)),
                        _mm256_or_si256(_mm256_and_si256(v1, nibble), _mm256_and_si256(bits, high)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble),
                                        _mm256_and_si256(_mm256_srli_epi16(bits, 2), high)),
                    };
                    for (int r = 0; r < MR; r++) {
                        int at = 32 * g + 16 * h;
                        __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], four(x, r0 + r, at)),
                                                     _mm256_maddubs_epi16(u[2], four(x, r0 + r, at + 8)));
                        __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(u[1], four(x, r0 + r, at + 4)),
                                                     _mm256_maddubs_epi16(u[3], four(x, r0 + r, at + 12)));
                        part[h][l][r] = _mm256_add_epi32(widen(a), widen(b));
                    }
                }
            }
            for (int r = 0; r < MR; r++) {
                float xs = x->xs[(size_t)(r0 + r) * x->G + g];
                const int32_t* sums = x->sums + (size_t)(r0 + r) * 2 * x->G + 2 * g;
                for (int h = 0; h < 2; h++) {
                    for (int l = 0; l < 2; l++) {
                        __m256i dot = _mm256_sub_epi32(part[h][l][r], _mm256_set1_epi32(32 * sums[h]));
                        acc[r].v[l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                      _mm256_mul_ps(scale[h].v[l], _mm256_set1_ps(xs)), acc[r].v[l]);
                    }
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void q8_0(const uint8_t* w, const Rows* x, int r0, F16* acc,
                                                       const int MR) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int g = 0; g < x->G; g++, w += Q8_0_BYTES) {
        prefetch(w, Q8_0_BYTES);
        F16 d = f16x16(w);
        for (int l = 0; l < 2; l++) {
            __m256i sum[MAX_ROWS];
            for (int r = 0; r < MR; r++) sum[r] = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                __m256i q = _mm256_xor_si256(load(w + 32 + 64 * k + 32 * l), flip);  // u - 128, as int8
                __m256i size = _mm256_abs_epi8(q);
                for (int r = 0; r < MR; r++) {
                    __m256i signed_x = _mm256_sign_epi8(four(x, r0 + r, 32 * g + 4 * k), q);
                    sum[r] = _mm256_add_epi32(sum[r], widen(_mm256_maddubs_epi16(size, signed_x)));
                }
            }
            for (int r = 0; r < MR; r++) {
                float xs = x->xs[(size_t)(r0 + r) * x->G + g];
                acc[r].v[l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d.v[l], _mm256_set1_ps(xs)),
                                              acc[r].v[l]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(int type, const uint8_t* w, const Rows* x, int r0,
                                                            F16* acc, const int MR) {
    for (int r = 0; r < MR; r++) acc[r].v[0] = acc[r].v[1] = _mm256_setzero_ps();
    if (type == Q4_K)
        q4_k(w, x, r0, acc, MR);
    else if (type == Q6_K)
        q6_k(w, x, r0, acc, MR);
    else if (type == Q4_1)
        q4_1(w, x, r0, acc, MR);
    else
        q8_0(w, x, r0, acc, MR);
}

// float32 -> bfloat16, rounding to nearest even (what VCVTNEPS2BF16 does; NaN is not produced by these sums)
static inline __m128i bf16x8(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

static void store(F16 v, void* y, size_t at, int keep, int bf16) {
    if (keep == TILE) {
        if (bf16) {
            _mm_storeu_si128((__m128i*)((uint16_t*)y + at), bf16x8(v.v[0]));
            _mm_storeu_si128((__m128i*)((uint16_t*)y + at + 8), bf16x8(v.v[1]));
        } else {
            _mm256_storeu_ps((float*)y + at, v.v[0]);
            _mm256_storeu_ps((float*)y + at + 8, v.v[1]);
        }
        return;
    }
    // the last, padded tile: its real outputs only
    if (bf16) {
        uint16_t tail[TILE];
        _mm_storeu_si128((__m128i*)tail, bf16x8(v.v[0]));
        _mm_storeu_si128((__m128i*)(tail + 8), bf16x8(v.v[1]));
        memcpy((uint16_t*)y + at, tail, sizeof(uint16_t) * (size_t)keep);
    } else {
        float tail[TILE];
        _mm256_storeu_ps(tail, v.v[0]);
        _mm256_storeu_ps(tail + 8, v.v[1]);
        memcpy((float*)y + at, tail, sizeof(float) * (size_t)keep);
    }
}

static inline __m256 loaded(const void* x, size_t at, int bf16) {  // 8 inputs from `at` as float32
    if (!bf16) return _mm256_loadu_ps((const float*)x + at);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline int32_t added(__m256i v) {  // the sum of 8 int32 lanes
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static inline float largest(__m256 v) {  // the max of 8 lanes
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, 0x4E));
    return _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, 0xB1)));
}

// x [M, I] (float32, or bfloat16 where `bf16`) -> the Rows it quantizes to, in `scratch` (kquant_vnni.c's values)
static void quantize_rows(const void* x, int M, int I, int bf16, int8_t* xq, float* xs, int32_t* sums) {
    int G = I / GROUP;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            size_t at = (size_t)r * I + (size_t)g * GROUP;
            __m256 v[4], top = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = loaded(x, at + 8 * k, bf16);
                top = _mm256_max_ps(top, _mm256_and_ps(v[k], magnitude));
            }
            float amax = largest(top);
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
            // int32 -> int8 through the in-lane packs, then the 4-byte groups back in input order
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i*)(xq + at), _mm256_permutevar8x32_epi32(bytes, order));
            xs[(size_t)r * G + g] = amax / 127.f;
            sums[(size_t)r * 2 * G + 2 * g] = added(_mm256_add_epi32(q[0], q[1]));
            sums[(size_t)r * 2 * G + 2 * g + 1] = added(_mm256_add_epi32(q[2], q[3]));
        }
    }
}

// One tile of outputs of y [M, O] = x W^T: tile t of W (format `type`), all M rows
static void one_tile(int type, const uint8_t* w, int O, int t, const Rows* rows, int M, void* y, int bf16) {
    int left = O - t * TILE, keep = left >= TILE ? TILE : left;
    F16 acc[MAX_ROWS];
    for (int r0 = 0; r0 < M; r0 += MAX_ROWS) {
        int n = M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS;
        switch (n) {
            case 1: tile_rows(type, w, rows, r0, acc, 1); break;
            case 2: tile_rows(type, w, rows, r0, acc, 2); break;
            case 3: tile_rows(type, w, rows, r0, acc, 3); break;
            case 4: tile_rows(type, w, rows, r0, acc, 4); break;
            case 5: tile_rows(type, w, rows, r0, acc, 5); break;
            case 6: tile_rows(type, w, rows, r0, acc, 6); break;
            case 7: tile_rows(type, w, rows, r0, acc, 7); break;
            default: tile_rows(type, w, rows, r0, acc, 8); break;
        }
        for (int r = 0; r < n; r++) store(acc[r], y, (size_t)(r0 + r) * O + (size_t)t * TILE, keep, bf16);
    }
}

