// y = x W^T + b for a few rows x (float32) and int8 weights W with one scale per output, on one core with AVX2.
//
// A draft step reads every weight once for one to a few tokens, so it costs the bytes it reads: this kernel
// streams the int8 weights once per call and keeps the activations in float32 (no per-call quantization, no
// range to reduce). Outputs are taken in tiles of 8, one register lane each, so no horizontal sums are needed:
// for every input k a tile's 8 weights (8 bytes) widen to float32 and multiply the broadcast x[r, k] of each row.
// Two tiles go side by side where the rows leave registers for them (2 x MR accumulators).
//
// Layout (speculative/engine/cpu/int8_avx2.py packs it): W [tiles, I, 8] int8 (byte 8k + lane of a tile is output
// 8 * tile + lane's weight for input k; outputs padded with zero weights to whole tiles), scale and bias [tiles * 8]
// float32.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE 8
#define MAX_ROWS 8

static inline __m256 widened(const int8_t* p) {  // 8 int8 -> 8 float32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// NT tiles from tile t against MR rows (both compile-time constants at each call site below); y [MR, O]
static inline __attribute__((always_inline)) void tiles_by_rows(
    const int8_t* W, int O, int I, const float* x, const float* scale, const float* bias, float* y, int t,
    const int MR, const int NT) {
    __m256 acc[4][MAX_ROWS];
    for (int j = 0; j < NT; j++)
        for (int r = 0; r < MR; r++) acc[j][r] = _mm256_setzero_ps();
    const int8_t* w = W + (size_t)t * I * TILE;
    for (int k = 0; k < I; k++) {
        __m256 wv[4];
        for (int j = 0; j < NT; j++) wv[j] = widened(w + ((size_t)j * I + k) * TILE);
        for (int r = 0; r < MR; r++) {
            __m256 xb = _mm256_broadcast_ss(x + (size_t)r * I + k);
            for (int j = 0; j < NT; j++) acc[j][r] = _mm256_fmadd_ps(wv[j], xb, acc[j][r]);
        }
    }
    for (int j = 0; j < NT; j++) {
        int n = (t + j) * TILE;
        __m256 s = _mm256_loadu_ps(scale + n), b = _mm256_loadu_ps(bias + n);
        for (int r = 0; r < MR; r++) {
            __m256 v = _mm256_fmadd_ps(acc[j][r], s, b);
            if (n + TILE <= O) {
                _mm256_storeu_ps(y + (size_t)r * O + n, v);
            } else {  // the last, padded tile: its real outputs only
                float tail[TILE];
                _mm256_storeu_ps(tail, v);
                memcpy(y + (size_t)r * O + n, tail, sizeof(float) * (size_t)(O - n));
            }
        }
    }
}

static inline __attribute__((always_inline)) void rows(
    const int8_t* W, int O, int I, const float* x, const float* scale, const float* bias, float* y, const int MR) {
    // NT x MR accumulators, NT weights and a broadcast in 16 registers, and at least 4 independent sums per input
    // (an FMA's latency is 4 of its issue slots)
    const int T = (O + TILE - 1) / TILE, NT = MR <= 2 ? 4 : MR == 3 ? 3 : MR <= 6 ? 2 : 1;
    int t = 0;
    for (; t + NT <= T; t += NT) tiles_by_rows(W, O, I, x, scale, bias, y, t, MR, NT);
    for (; t < T; t++) tiles_by_rows(W, O, I, x, scale, bias, y, t, MR, 1);
}

// W as laid out above, O outputs, I inputs, x [M, I], scale and bias [tiles * 8], y [M, O]; 0, or -1 for M out of
// 1..MAX_ROWS
int int8_avx2_mm(const int8_t* W, int O, int I, const float* x, int M, const float* scale, const float* bias,
                 float* y) {
    switch (M) {
        case 1: rows(W, O, I, x, scale, bias, y, 1); return 0;
        case 2: rows(W, O, I, x, scale, bias, y, 2); return 0;
        case 3: rows(W, O, I, x, scale, bias, y, 3); return 0;
        case 4: rows(W, O, I, x, scale, bias, y, 4); return 0;
        case 5: rows(W, O, I, x, scale, bias, y, 5); return 0;
        case 6: rows(W, O, I, x, scale, bias, y, 6); return 0;
        case 7: rows(W, O, I, x, scale, bias, y, 7); return 0;
        case 8: rows(W, O, I, x, scale, bias, y, 8); return 0;
        default: return -1;
    }
}
