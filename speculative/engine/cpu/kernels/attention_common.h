// What the invariant attention kernels (attention.c, attention_avx2.c) share: the loop over sequences, heads and
// query rows, each row computed alone by the kernel's `row` (declared here, defined by the kernel that includes
// this after it; VECTOR: its float32 lanes, a divisor of the head widths it takes), and the rotary embedding of
// the queries and keys it attends with.
#ifndef ATTENTION_COMMON_H
#define ATTENTION_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

// One query row against C columns; `scores` scratch of C + 16 floats.
static void row(const float* q, const uint8_t* k, const uint8_t* v, long col_bytes, const float* mask, int C, int D,
                int bf16, float* scores, float* out);

// Returns 0, or -1 (nothing written) for a head width it does not take or no memory.
int attend(const float* q, long q_b, long q_h, long q_m, const void* k, const void* v, long kv_b, long kv_h,
           long kv_c, const float* mask, long mask_b, long mask_r, int b, int heads, int kv_heads, int m, int C, int D,
           int bf16, float* out) {
    if (D % VECTOR || D > 256 || heads % kv_heads) return -1;
    float* scores = (float*)malloc(sizeof(float) * ((size_t)C + 32));
    if (!scores) return -1;
    int g = heads / kv_heads, width = bf16 ? 2 : 4;
    for (int s = 0; s < b; s++)
        for (int h = 0; h < heads; h++) {
            const uint8_t* ks = (const uint8_t*)k + (size_t)width * (s * kv_b + (h / g) * kv_h);
            const uint8_t* vs = (const uint8_t*)v + (size_t)width * (s * kv_b + (h / g) * kv_h);
            for (int i = 0; i < m; i++) {
                const float* mrow = mask + s * mask_b + ((long)(h % g) * m + i) * mask_r;
                float* o = out + (((size_t)s * m + i) * heads + h) * D;
                row(q + s * q_b + h * q_h + i * q_m, ks, vs, (long)width * kv_c, mrow, C, D, bf16, scores, o);
            }
        }
    free(scores);
    return 0;
}

// x [T, heads, D] float32 rotated in place by its tokens' cos and sin [T, D], as Llama's and Qwen2's
// `apply_rotary_pos_emb` rotates halves: x * cos + concat(-x[D/2:], x[:D/2]) * sin. Each product is rounded, then
// the two added (these builds contract no multiply-add), so the bits are torch's for the same float32 tensors.
void rotate_halves(float* x, int T, int heads, int D, const float* cos, const float* sin) {
    int half = D / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float* p = x + ((size_t)t * heads + h) * D;
            const float* c = cos + (size_t)t * D;
            const float* s = sin + (size_t)t * D;
            for (int j = 0; j < half; j++) {
                float a = p[j], b = p[j + half];
                p[j] = a * c[j] + (-b) * s[j];
                p[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
}
#endif
