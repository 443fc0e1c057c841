// y = x W^T for a few rows x (bfloat16) and 4-bit weight groups W, on one core with AVX-512 VNNI.
//
// A draft step reads every weight once for one to a few tokens, so it costs the bytes it reads: this kernel
// streams the weights once per call, in the order it uses them, and keeps the arithmetic off the critical
// path. Each row of x is quantized to int8 per group of 32 inputs (scale = max |x| / 127); a group's 4-bit
// weights q (0..15, w = scale_w * q + min_w) multiply it with VPDPBUSD (u8 x s8 -> s32), 16 outputs per
// register lane set, so no horizontal sums are needed:
//   sum_i w_i x_i = scale_x * (scale_w * sum_i q_i xq_i + min_w * sum_i xq_i)
//
// Layout (speculative/int4_vnni.py packs it): outputs in tiles of 16, each tile's groups in order, each
// group a 320-byte block: 4 chunks of 64 bytes (inputs 8c..8c+7 of the group: byte 4 * lane + b holds
// input 8c + b in its low nibble and 8c + 4 + b in its high nibble, lane = output within the tile), then
// the 16 outputs' scales and then their minimums as bfloat16.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define GROUP 32
#define BLOCK 320
// Bytes ahead of the block in use, fetched into L2 (not L1: a stream there evicts the rows and sums the
// loop reuses): a draft level of Qwen 0.5B takes ~9 % less than with 16 blocks ahead into L1.
#define PREFETCH (32 * BLOCK)
#define MAX_ROWS 8

static inline __m512 bf16x16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [M, I] bfloat16 -> xq [M, I] int8; xs, xsum [M, G]: each group's scale and scale * sum of its xq
static void quantize_rows(const uint16_t* x, int M, int I, int8_t* xq, float* xs, float* xsum) {
    int G = I / GROUP;
    for (int r = 0; r < M; r++) {
        for (int g = 0; g < G; g++) {
            const uint16_t* p = x + (size_t)r * I + g * GROUP;
            __m512 a = bf16x16(p), b = bf16x16(p + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
            __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
            int8_t* o = xq + (size_t)r * I + g * GROUP;
            _mm_storeu_si128((__m128i*)o, _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i*)(o + 16), _mm512_cvtsepi32_epi8(qb));
            xs[r * G + g] = s;
            xsum[r * G + g] = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
    }
}

// MR rows (a compile-time constant at each call site below) against every tile; y [MR, O] bfloat16
static inline __attribute__((always_inline)) void rows_by_tiles(
    const uint8_t* W, int O, int I, const int8_t* xq, const float* xs, const float* xsum, uint16_t* y, const int MR) {
    const int G = I / GROUP, T = (O + TILE - 1) / TILE;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const uint8_t* w = W;
    for (int t = 0; t < T; t++) {
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++, w += BLOCK) {
            for (int line = 0; line < BLOCK; line += 64) _mm_prefetch((const char*)(w + PREFETCH + line), _MM_HINT_T1);
            __m512i lo_acc[MAX_ROWS], hi_acc[MAX_ROWS];  // two chains per row: VPDPBUSD's latency
            for (int r = 0; r < MR; r++) lo_acc[r] = hi_acc[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void*)(w + 64 * c));
                __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (int r = 0; r < MR; r++) {
                    int32_t x0, x1;  // inputs 8c..8c+3 and 8c+4..8c+7 of this row's group, as 4 int8 each
                    memcpy(&x0, xq + (size_t)r * I + g * GROUP + 8 * c, 4);
                    memcpy(&x1, xq + (size_t)r * I + g * GROUP + 8 * c + 4, 4);
                    lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], lo, _mm512_set1_epi32(x0));
                    hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, _mm512_set1_epi32(x1));
                }
            }
            __m512 scale = bf16x16((const uint16_t*)(w + 256)), low = bf16x16((const uint16_t*)(w + 288));
            for (int r = 0; r < MR; r++) {
                __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_acc[r], hi_acc[r]));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * G + g])), acc[r]);
                acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[r * G + g]), acc[r]);
            }
        }
        int left = O - t * TILE;
        __mmask16 keep = left >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < MR; r++)
            _mm256_mask_storeu_epi16(y + (size_t)r * O + t * TILE, keep, (__m256i)_mm512_cvtneps_pbh(acc[r]));
    }
}

static __thread int8_t* scratch;  // per thread: xq, then xs and xsum
static __thread size_t scratch_bytes;

// y [M, O] = x [M, I] W^T, all bfloat16; 1 <= M <= MAX_ROWS, I a multiple of GROUP. Returns 0, or -1 when M
// is out of range or scratch memory cannot be had (nothing written).
int int4_vnni_mm(const uint8_t* W, int O, int I, const uint16_t* x, int M, uint16_t* y) {
    if (M < 1 || M > MAX_ROWS || I % GROUP) return -1;
    int G = I / GROUP;
    size_t need = (size_t)M * I + 2 * sizeof(float) * (size_t)M * G;
    if (need > scratch_bytes) {
        free(scratch);
        scratch = (int8_t*)malloc(need);
        scratch_bytes = scratch ? need : 0;
        if (!scratch) return -1;
    }
    int8_t* xq = scratch;
    float* xs = (float*)(scratch + (size_t)M * I);
    float* xsum = xs + (size_t)M * G;
    quantize_rows(x, M, I, xq, xs, xsum);
    switch (M) {
        case 1: rows_by_tiles(W, O, I, xq, xs, xsum, y, 1); break;
        case 2: rows_by_tiles(W, O, I, xq, xs, xsum, y, 2); break;
        case 3: rows_by_tiles(W, O, I, xq, xs, xsum, y, 3); break;
        case 4: rows_by_tiles(W, O, I, xq, xs, xsum, y, 4); break;
        case 5: rows_by_tiles(W, O, I, xq, xs, xsum, y, 5); break;
        case 6: rows_by_tiles(W, O, I, xq, xs, xsum, y, 6); break;
        case 7: rows_by_tiles(W, O, I, xq, xs, xsum, y, 7); break;
        default: rows_by_tiles(W, O, I, xq, xs, xsum, y, 8); break;
    }
    return 0;
}
