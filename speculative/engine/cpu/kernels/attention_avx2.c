// Attention with each query row's sums fixed by the row alone (AVX2 and FMA; attention.c's twin for CPUs
// without AVX-512): batch invariant by construction.
//
// The same computation as attention.c, 8 lanes at a time: for query row i of head h (KV head h / g),
//   s_c = q . k_c + mask_c;  w_c = exp(s_c - max s);  out = sum_c w_c v_c / sum_c w_c   (q scaled before)
// in float32, columns in order, each dot product over the head's width in a fixed order (8 lanes, then their
// sum in a fixed tree). A row's result depends on its own query, keys, values and mask row alone, in the order
// of its visible columns: a score more than 87 below the row's maximum weighs exactly 0, and every sum over
// columns runs column by column, so zeros change no bit. exp is attention.c's degree-6 polynomial, scaled by
// 2^n through the exponent bits.
//
// Shapes: attention.c's (attention_common.h's `attend`).
#define VECTOR 8
#include "attention_common.h"

#include <immintrin.h>

static inline __m256 load8(const void* p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)p);
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 exp8(__m256 x) {  // exp(x) for x <= 0; 0 below -87
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // (masked below) keeps 2^n a normal number
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, ln2_hi, x);
    f = _mm256_fnmadd_ps(n, ln2_lo, f);
    __m256 p = _mm256_set1_ps(1.3981999507e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

static inline float added(__m256 v) {  // the sum of 8 lanes, in a fixed tree
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One query row against C columns; `scores` scratch of C + 16 floats. D a multiple of 8, at most 256.
static void row(const float* q, const uint8_t* k, const uint8_t* v, long col_bytes, const float* mask, int C, int D,
                int bf16, float* scores, float* out) {
    int vectors = D / 8, width = bf16 ? 2 : 4;
    __m256 qv[32];
    for (int j = 0; j < vectors; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
    float top = -INFINITY;
    for (int c = 0; c < C; c++) {
        const uint8_t* kc = k + c * col_bytes;
        __m256 acc = _mm256_mul_ps(qv[0], load8(kc, bf16));
        for (int j = 1; j < vectors; j++) acc = _mm256_fmadd_ps(qv[j], load8(kc + 8 * j * width, bf16), acc);
        float s = added(acc) + mask[c];
        scores[c] = s;
        top = s > top ? s : top;
    }
    for (int c = C; c < C + 8; c++) scores[c] = -INFINITY;
    __m256 topv = _mm256_set1_ps(top);
    for (int c = 0; c < C; c += 8) _mm256_storeu_ps(scores + c, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + c), topv)));
    // the weights summed one by one, in column order (attention.c says why)
    float total = 0.0f;
    for (int c = 0; c < C; c++) total += scores[c];
    __m256 o[32];
    for (int j = 0; j < vectors; j++) o[j] = _mm256_setzero_ps();
    for (int c = 0; c < C; c++) {
        if (scores[c] == 0.0f) continue;  // exact zeros add nothing
        __m256 w = _mm256_set1_ps(scores[c]);
        const uint8_t* vc = v + c * col_bytes;
        for (int j = 0; j < vectors; j++) o[j] = _mm256_fmadd_ps(w, load8(vc + 8 * j * width, bf16), o[j]);
    }
    __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int j = 0; j < vectors; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(o[j], inv));
}
