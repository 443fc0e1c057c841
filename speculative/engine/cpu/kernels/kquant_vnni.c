// y = x W^T for GGUF-quantized weights W (Q4_K, Q6_K, Q8_0) at their stored precision, AVX-512 VNNI.
//
// A target's decode step reads every weight once, so it costs the bytes it reads: these kernels read the
// weights as the GGUF file stores them (4.6, 6.6 and 8.5 bits a weight with their scales), never expanded.
// Each row of x is quantized to int8 per group of 32 inputs (scale = max |x| / 127), and the weights' codes
// u (unsigned bytes) multiply it with VPDPBUSD (u8 x s8 -> s32), 16 outputs per register, so no horizontal
// sums are needed. Per format, with xq the row's int8 values and xs its group scale:
//   Q4_K  w = d * sc * u - dmin * m   (u 0..15, sc and m 6-bit per 32 inputs, d and dmin per 256)
//         sum w x = xs * (d * sc * sum u xq - dmin * m * sum xq)
//   Q6_K  w = d * sc * (u - 32)       (u 0..63, sc int8 per 16 inputs, d per 256)
//         sum w x = xs * d * sc * (sum u xq - 32 sum xq)
//   Q8_0  w = d * (u - 128)           (u = q + 128 of the int8 q, d per 32 inputs)
//         sum w x = xs * d * (sum u xq - 128 sum xq)
// Every scale is the file's (fp16 d, integer sc and m), multiplied here in float32 as the GGUF reference does.
//
// Batch invariance by construction: each row's outputs are reduced alone, in the order of the inputs, the
// same for 1 row or 64, on one thread or several (threads split the outputs, never a sum).
//
// Layout (speculative/engine/cpu/kquant.py packs it): outputs in tiles of 16; a tile's inputs in order, as
// blocks (a byte at 4 * lane + b of a 64-byte chunk belongs to output `lane` of the tile):
//   Q4_K, per 256 inputs (2368 bytes): d[16] fp16, dmin[16] fp16, sc[8][16] u8, m[8][16] u8, then per group
//     of 32 inputs 4 chunks of 64 bytes: chunk c holds input 8c + b in the low nibble, 8c + 4 + b in the high.
//   Q6_K, per 256 inputs (3360 bytes): d[16] fp16, sc[16][16] int8 (per 16 inputs), then per group of 32
//     inputs 4 chunks of nibbles as in Q4_K (the low 4 bits of u), and 2 chunks of high bits: byte 4 * lane + b
//     of high chunk h holds bits 4-5 of u for inputs 16h + b (bits 0-1), 16h + 4 + b (2-3), 16h + 8 + b (4-5)
//     and 16h + 12 + b (6-7).
//   Q8_0, per 32 inputs (544 bytes): d[16] fp16, then 8 chunks of 64 bytes: chunk k holds input 4k + b.
#include "kquant_common.h"  // first: it defines _GNU_SOURCE

#include <immintrin.h>

#define MAX_ROWS 8
#define CHAINED_ROWS 4  // from this many rows up, a row's integer sums run in one chain

static inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512 u8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 i8x16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512i four(const Rows* x, int r, int input) {  // 4 int8 of row r from `input`, in every lane
    int32_t v;
    memcpy(&v, x->xq + (size_t)r * x->I + input, 4);
    return _mm512_set1_epi32(v);
}
static inline void prefetch(const uint8_t* w, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char*)(w + PREFETCH + line), _MM_HINT_T0);
}

// One tile's 16 outputs for rows r0 .. r0 + MR - 1 (MR a constant at each call site): acc[r] += their sums
static inline __attribute__((always_inline)) void q4_k(const uint8_t* w, const Rows* x, int r0, __m512* acc,
                                                       const int MR) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < x->I / 256; s++, w += Q4_K_BYTES) {
        __m512 d = f16x16(w), dmin = f16x16(w + 32);
        for (int j = 0; j < 8; j++) {
            int g = 8 * s + j;
            prefetch(w + j * (Q4_K_BYTES / 8), Q4_K_BYTES / 8);
            const uint8_t* q = w + 320 + 256 * j;
            __m512 scale = _mm512_mul_ps(d, u8x16(w + 64 + 16 * j));
            __m512 low = _mm512_mul_ps(dmin, u8x16(w + 192 + 16 * j));
            // a row's sums in one chain where several rows' chains hide VPDPBUSD's latency, else in two
            __m512i lo_acc[MAX_ROWS], hi_acc[MAX_ROWS];
            for (int r = 0; r < MR; r++) lo_acc[r] = hi_acc[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void*)(q + 64 * c));
                __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (int r = 0; r < MR; r++) {
                    lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, four(x, r0 + r, 32 * g + 8 * c));
                    if (MR < CHAINED_ROWS)
                        hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, four(x, r0 + r, 32 * g + 8 * c + 4));
                    else
                        lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], hi, four(x, r0 + r, 32 * g + 8 * c + 4));
                }
            }
            for (int r = 0; r < MR; r++) {
                float xs = x->xs[(size_t)(r0 + r) * x->G + g];
                const int32_t* sums = x->sums + (size_t)(r0 + r) * 2 * x->G + 2 * g;
                __m512 dot = _mm512_cvtepi32_ps(MR < CHAINED_ROWS ? _mm512_add_epi32(lo_acc[r], hi_acc[r]) : lo_acc[r]);
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs)), acc[r]);
                acc[r] = _mm512_fnmadd_ps(low, _mm512_set1_ps(xs * (float)(sums[0] + sums[1])), acc[r]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void q6_k(const uint8_t* w, const Rows* x, int r0, __m512* acc,
                                                       const int MR) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    for (int s = 0; s < x->I / 256; s++, w += Q6_K_BYTES) {
        __m512 d = f16x16(w);
        for (int j = 0; j < 8; j++) {
            int g = 8 * s + j;
            prefetch(w + j * (Q6_K_BYTES / 8), Q6_K_BYTES / 8);
            const uint8_t* q = w + 288 + 384 * j;
            __m512 scale[2] = {_mm512_mul_ps(d, i8x16(w + 32 + 32 * j)), _mm512_mul_ps(d, i8x16(w + 48 + 32 * j))};
            __m512i part[2][MAX_ROWS];  // per row, the sums of its two halves of 16 inputs
            for (int h = 0; h < 2; h++) {
                __m512i bits = _mm512_loadu_si512((const void*)(q + 256 + 64 * h));
                __m512i v0 = _mm512_loadu_si512((const void*)(q + 128 * h)), v1 = _mm512_loadu_si512((const void*)(q + 128 * h + 64));
                __m512i u[4] = {
                    _mm512_or_si512(_mm512_and_si512(v0, nibble), _mm512_and_si512(_mm512_slli_epi16(bits, 4), high)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble),
                                    _mm512_and_si512(_mm512_slli_epi16(bits, 2), high)),
                    _mm512_or_si512(_mm512_and_si512(v1, nibble), _mm512_and_si512(bits, high)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble),
                                    _mm512_and_si512(_mm512_srli_epi16(bits, 2), high)),
                };
                for (int r = 0; r < MR; r++) {
                    int at = 32 * g + 16 * h;
                    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], four(x, r0 + r, at));
                    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], four(x, r0 + r, at + 4));
                    a = _mm512_dpbusd_epi32(a, u[2], four(x, r0 + r, at + 8));
                    b = _mm512_dpbusd_epi32(b, u[3], four(x, r0 + r, at + 12));
                    part[h][r] = _mm512_add_epi32(a, b);
                }
            }
            for (int r = 0; r < MR; r++) {
                float xs = x->xs[(size_t)(r0 + r) * x->G + g];
                const int32_t* sums = x->sums + (size_t)(r0 + r) * 2 * x->G + 2 * g;
                for (int h = 0; h < 2; h++) {
                    __m512i dot = _mm512_sub_epi32(part[h][r], _mm512_set1_epi32(32 * sums[h]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale[h], _mm512_set1_ps(xs)), acc[r]);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void q8_0(const uint8_t* w, const Rows* x, int r0, __m512* acc,
                                                       const int MR) {
    for (int g = 0; g < x->G; g++, w += Q8_0_BYTES) {
        prefetch(w, Q8_0_BYTES);
        __m512 d = f16x16(w);
        __m512i a[MAX_ROWS], b[MAX_ROWS];
        for (int r = 0; r < MR; r++) a[r] = b[r] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k += 2) {
            __m512i u0 = _mm512_loadu_si512((const void*)(w + 32 + 64 * k));
            __m512i u1 = _mm512_loadu_si512((const void*)(w + 96 + 64 * k));
            for (int r = 0; r < MR; r++) {
                a[r] = _mm512_dpbusd_epi32(a[r], u0, four(x, r0 + r, 32 * g + 4 * k));
                b[r] = _mm512_dpbusd_epi32(b[r], u1, four(x, r0 + r, 32 * g + 4 * k + 4));
            }
        }
        for (int r = 0; r < MR; r++) {
            float xs = x->xs[(size_t)(r0 + r) * x->G + g];
            const int32_t* sums = x->sums + (size_t)(r0 + r) * 2 * x->G + 2 * g;
            __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(a[r], b[r]), _mm512_set1_epi32(128 * (sums[0] + sums[1])));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xs)), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(int type, const uint8_t* w, const Rows* x, int r0,
                                                            __m512* acc, const int MR) {
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    if (type == Q4_K)
        q4_k(w, x, r0, acc, MR);
    else if (type == Q6_K)
        q6_k(w, x, r0, acc, MR);
    else
        q8_0(w, x, r0, acc, MR);
}

static void store(__m512 v, void* y, size_t at, __mmask16 keep, int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t*)y + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float*)y + at, keep, v);
}

// x [M, I] (float32, or bfloat16 where `bf16`) -> the Rows it quantizes to, in `scratch`
static void quantize_rows(const void* x, int M, int I, int bf16, int8_t* xq, float* xs, int32_t* sums) {
    int G = I / GROUP;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            size_t at = (size_t)r * I + (size_t)g * GROUP;
            __m512 a, b;
            if (bf16) {
                const uint16_t* p = (const uint16_t*)x + at;
                a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
                b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16))), 16));
            } else {
                a = _mm512_loadu_ps((const float*)x + at);
                b = _mm512_loadu_ps((const float*)x + at + 16);
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
            __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i*)(xq + at), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i*)(xq + at + 16), _mm512_cvtsepi32_epi8(qb));
            xs[(size_t)r * G + g] = amax / 127.f;
            sums[(size_t)r * 2 * G + 2 * g] = _mm512_reduce_add_epi32(qa);
            sums[(size_t)r * 2 * G + 2 * g + 1] = _mm512_reduce_add_epi32(qb);
        }
    }
}

// One tile of outputs of y [M, O] = x W^T: tile t of W (format `type`), all M rows
static void one_tile(int type, const uint8_t* w, int O, int t, const Rows* rows, int M, void* y, int bf16) {
    int left = O - t * TILE;
    __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 acc[MAX_ROWS];
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

