// What the GGUF weights' kernels (kquant_vnni.c, kquant_avx2.c) share: the formats' constants, the quantized
// rows, and the driver, which quantizes x once per call and splits the tiles of outputs among threads. A kernel
// includes this first and defines the two functions declared here, its instruction set's work.
#ifndef KQUANT_COMMON_H
#define KQUANT_COMMON_H
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define GROUP 32
#define Q4_K 12  // GGML's type ids
#define Q6_K 14
#define Q8_0 8
#define Q4_1 3
#define Q4_K_BYTES 2368  // per tile and 256 inputs
#define Q6_K_BYTES 3360
#define Q8_0_BYTES 544  // per tile and 32 inputs
#define Q4_1_BYTES 320
#define PREFETCH 1024  // bytes ahead of the block in use, fetched into L1

typedef struct {
    const int8_t* xq;  // [M, I] int8
    const float* xs;  // [M, G] each group's scale
    const int32_t* sums;  // [M, 2G] sum of xq per 16 inputs
    int I, G;
} Rows;

// x [M, I] (float32, or bfloat16 where `bf16`) -> the Rows it quantizes to: xq [M, I], xs [M, G], sums [M, 2G]
static void quantize_rows(const void* x, int M, int I, int bf16, int8_t* xq, float* xs, int32_t* sums);
// One tile of outputs of y [M, O] = x W^T: tile t of W (format `type`), all M rows
static void one_tile(int type, const uint8_t* w, int O, int t, const Rows* rows, int M, void* y, int bf16);

static __thread int8_t* scratch;
static __thread size_t scratch_bytes;

// Bytes of one tile's weights of `I` inputs in format `type`; 0 for a format or width this kernel does not take
// (Q4_1 where the kernel defines KQUANT_Q4_1)
long kquant_tile_bytes(int type, int I) {
    if (type == Q4_K && I % 256 == 0) return (long)(I / 256) * Q4_K_BYTES;
    if (type == Q6_K && I % 256 == 0) return (long)(I / 256) * Q6_K_BYTES;
    if (type == Q8_0 && I % 32 == 0) return (long)(I / 32) * Q8_0_BYTES;
#ifdef KQUANT_Q4_1
    if (type == Q4_1 && I % 32 == 0) return (long)(I / 32) * Q4_1_BYTES;
#endif
    return 0;
}

#include "kquant_pack.h"  // kquant_pack: a GGUF tensor's blocks into this layout

static inline float input(const void* x, size_t at, int bf16) {  // x[at] as float32
    if (!bf16) return ((const float*)x)[at];
    uint32_t bits = (uint32_t)((const uint16_t*)x)[at] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// x [M, I] (float32, or bfloat16 where `bf16`) -> out [M, I] float32, Llama's and Qwen2's RMS norm in float32: each
// row times 1 / sqrt(mean of its squares + eps), times w [I]. The squares are summed in 8 running sums (input i
// into sum i mod 8) added in a fixed order, so a row's result is its own whatever M (I a multiple of 8).
static void normalized_rows(const void* x, int M, int I, int bf16, const float* w, float eps, float* out) {
    for (int r = 0; r < M; r++) {
        size_t at = (size_t)r * I;
        float part[8] = {0};
        for (int i = 0; i < I; i++) {
            float v = input(x, at + i, bf16);
            part[i % 8] += v * v;
        }
        float squares = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        float scale = 1.0f / sqrtf(squares / (float)I + eps);
        for (int i = 0; i < I; i++) out[at + i] = input(x, at + i, bf16) * scale * w[i];
    }
}

// ys[k] [M, Os[k]] = x [M, I] Ws[k]^T for k < n (x and y float32, or bfloat16 where `bf16`): x is quantized
// once, and `threads` threads split the tiles of outputs of all n weights (q, k and v of a layer in one call).
// With `norm` (w [I] float32, not NULL) the product is of x's rows RMS-normalized (`normalized_rows`, `eps`): the
// norm before a layer's projections, applied as the kernel reads its input.
// Returns 0, or -1 (nothing written) for a format or width not taken, n outside 1..8, M < 1, or no memory.
int kquant_mm_many(int n, const int* types, const uint8_t* const* Ws, const int* Os, int I, const void* x, int M,
                   void* const* ys, int bf16, int threads, const float* norm, float eps) {
    if (n < 1 || n > 8 || M < 1) return -1;
    long tile_bytes[8];
    int first[9] = {0};  // first[k]: weight k's first tile in the joint order
    for (int k = 0; k < n; k++) {
        tile_bytes[k] = kquant_tile_bytes(types[k], I);
        if (tile_bytes[k] == 0) return -1;
        first[k + 1] = first[k] + (Os[k] + TILE - 1) / TILE;
    }
    int G = I / GROUP;
    size_t normed = norm ? sizeof(float) * (size_t)M * I : 0;
    size_t need = (size_t)M * I + sizeof(float) * (size_t)M * G + sizeof(int32_t) * 2 * (size_t)M * G + normed + 128;
    if (need > scratch_bytes) {
        free(scratch);
        scratch = (int8_t*)malloc(need);
        scratch_bytes = scratch ? need : 0;
        if (!scratch) return -1;
    }
    float* xs = (float*)(((uintptr_t)(scratch + (size_t)M * I) + 63) & ~(uintptr_t)63);
    int32_t* sums = (int32_t*)(xs + (size_t)M * G);
    if (norm) {
        float* rows = (float*)(((uintptr_t)(sums + 2 * (size_t)M * G) + 63) & ~(uintptr_t)63);
        normalized_rows(x, M, I, bf16, norm, eps, rows);
        quantize_rows(rows, M, I, 0, scratch, xs, sums);
    } else {
        quantize_rows(x, M, I, bf16, scratch, xs, sums);
    }
    Rows rows = {scratch, xs, sums, I, G};
    // guided: a thread that the OS preempts (a borrowed core's other work) leaves its share to the others
#pragma omp parallel for schedule(guided, 8) num_threads(threads > 0 ? threads : 1)
    for (int j = 0; j < first[n]; j++) {
        int k = 0;
        while (j >= first[k + 1]) k++;
        int t = j - first[k];
        one_tile(types[k], Ws[k] + (size_t)t * tile_bytes[k], Os[k], t, &rows, M, ys[k], bf16);
    }
    return 0;
}

// y [M, O] = x [M, I] W^T: `kquant_mm_many` of one weight.
int kquant_mm(int type, const uint8_t* W, int O, int I, const void* x, int M, void* y, int bf16, int threads) {
    return kquant_mm_many(1, &type, &W, &O, I, x, M, &y, bf16, threads, NULL, 0.0f);
}

// Pins the threads of a later kquant_mm(threads = n): thread i (i >= 1) to core cores[i]; thread 0, the caller,
// stays where it is. A thread's team belongs to its calling thread, so the caller pins before each use. Returns 0,
// or -1 where a core was refused (the threads run where they were).
int kquant_place(const int* cores, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(| : failed)
    {
        int i = omp_get_thread_num();
        if (i > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cores[i], &set);
            failed |= sched_setaffinity(0, sizeof set, &set) != 0;
        }
    }
    return failed ? -1 : 0;
}
#endif
