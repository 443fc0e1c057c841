// Attention with each query row's sums fixed by the row alone (AVX-512): batch invariant by construction.
//
// For query row i of head h (KV head h / g, g = heads / kv_heads), over the C key columns of its sequence:
//   s_c = q . k_c + mask_c;  w_c = exp(s_c - max s);  out = sum_c w_c v_c / sum_c w_c   (q scaled before)
// in float32, columns in order, each dot product over the head's width in a fixed order. A row's result
// depends on its own query, keys, values and mask row alone, in the order of its visible columns: not on the
// other rows of the call, nor on masked columns before, between or after them (a score more than 87 below the
// row's maximum weighs exactly 0, and every sum over columns runs column by column, so zeros change no bit). exp is a degree-6 polynomial on [-ln2/2, ln2/2] scaled by 2^n (relative error ~2e-7).
//
// Shapes (element strides given for the batch, head and column dimensions; the head width D contiguous):
//   q [b, heads, m, D], k and v [b, kv_heads, C, D] (float32, or bfloat16 where `bf16`), mask [b, g * m, C]
//   float32 (head kv * g + r, query i -> mask row r * m + i), out [b, m, heads, D] float32.
#define VECTOR 16
#include "attention_common.h"

#include <immintrin.h>

static inline __m512 load16(const void* p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)p);
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 exp16(__m512 x) {  // exp(x) for x <= 0; 0 below -87
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, ln2_hi, x);
    f = _mm512_fnmadd_ps(n, ln2_lo, f);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// One query row against C columns; `scores` scratch of C + 16 floats. D a multiple of 16, at most 256.
static void row(const float* q, const uint8_t* k, const uint8_t* v, long col_bytes, const float* mask, int C, int D,
                int bf16, float* scores, float* out) {
    int vectors = D / 16, width = bf16 ? 2 : 4;
    __m512 qv[16];
    for (int j = 0; j < vectors; j++) qv[j] = _mm512_loadu_ps(q + 16 * j);
    float top = -INFINITY;
    for (int c = 0; c < C; c++) {
        const uint8_t* kc = k + c * col_bytes;
        __m512 acc = _mm512_mul_ps(qv[0], load16(kc, bf16));
        for (int j = 1; j < vectors; j++) acc = _mm512_fmadd_ps(qv[j], load16(kc + 16 * j * width, bf16), acc);
        float s = _mm512_reduce_add_ps(acc) + mask[c];
        scores[c] = s;
        top = s > top ? s : top;
    }
    for (int c = C; c < C + 16; c++) scores[c] = -INFINITY;
    __m512 topv = _mm512_set1_ps(top);
    for (int c = 0; c < C; c += 16) _mm512_storeu_ps(scores + c, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + c), topv)));
    // the weights summed one by one, in column order: a tree's node sees its ancestors at other columns than
    // the same tokens in a chain, with masked siblings (exact zeros) between them, and only a sequential sum
    // is blind to where zeros stand (a sum by SIMD lanes would group the same weights otherwise)
    float total = 0.0f;
    for (int c = 0; c < C; c++) total += scores[c];
    __m512 o[16];
    for (int j = 0; j < vectors; j++) o[j] = _mm512_setzero_ps();
    for (int c = 0; c < C; c++) {
        if (scores[c] == 0.0f) continue;  // exact zeros add nothing
        __m512 w = _mm512_set1_ps(scores[c]);
        const uint8_t* vc = v + c * col_bytes;
        for (int j = 0; j < vectors; j++) o[j] = _mm512_fmadd_ps(w, load16(vc + 16 * j * width, bf16), o[j]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int j = 0; j < vectors; j++) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(o[j], inv));
}
