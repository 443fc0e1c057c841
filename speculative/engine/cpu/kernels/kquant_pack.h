// A GGUF tensor's blocks, as the file stores them, laid out for the kernels (the layout in kquant_vnni.c's header),
// in one pass over the bytes: a 1.5B target's Linear layers in ~0.4 s where kquant.py's `pack` of decoded codes
// (the readable definition, and the test's reference) takes ~6 s on one core. Included by kquant_common.h.
#ifndef KQUANT_PACK_H
#define KQUANT_PACK_H
#include <stdint.h>
#include <string.h>

// Q4_K's 6-bit scale (`min` 0) or minimum (`min` 1) of 32-input group j, from the block's 12 packed bytes p
static inline uint8_t q4_k_scale(const uint8_t* p, int j, int min) {
    if (j < 4) return p[j + 4 * min] & 63;
    return min ? (uint8_t)((p[j + 4] >> 4) | ((p[j] >> 6) << 4)) : (uint8_t)((p[j + 4] & 15) | ((p[j - 4] >> 6) << 4));
}

static inline uint32_t load4(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline void store4(uint8_t* p, uint32_t v) { memcpy(p, &v, 4); }

#define LOW_NIBBLES 0x0F0F0F0Fu

// Four bytes of a 64-byte chunk hold lane `lane`'s inputs 8c + b (low nibble) and 8c + 4 + b (high), b < 4: given
// the 4-bit codes of inputs 8c .. 8c + 3 in the low nibbles of `first` and of 8c + 4 .. 8c + 7 in `second`'s
static inline void store_nibbles(uint8_t* chunk, int lane, uint32_t first, uint32_t second) {
    store4(chunk + 4 * lane, (first & LOW_NIBBLES) | ((second & LOW_NIBBLES) << 4));
}

// One output's Q4_K block (144 bytes: d, dmin fp16, 12 bytes of scales, 128 of nibbles) into lane `lane` of `dst`,
// its tile's 2368 bytes for these 256 inputs. Input 64k + 32h + l of the block is nibble h of qs[32k + l]: group
// j = 2k + h.
static void pack_q4_k(const uint8_t* restrict block, int lane, uint8_t* restrict dst) {
    memcpy(dst + 2 * lane, block, 2);
    memcpy(dst + 32 + 2 * lane, block + 2, 2);
    for (int j = 0; j < 8; j++) {
        dst[64 + 16 * j + lane] = q4_k_scale(block + 4, j, 0);
        dst[192 + 16 * j + lane] = q4_k_scale(block + 4, j, 1);
    }
    for (int j = 0; j < 8; j++) {
        const uint8_t* q = block + 16 + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int c = 0; c < 4; c++)
            store_nibbles(dst + 320 + 256 * j + 64 * c, lane, load4(q + 8 * c) >> shift, load4(q + 8 * c + 4) >> shift);
    }
}

// One output's Q6_K block (210 bytes: ql[128], qh[64], 16 int8 scales, d fp16) into lane `lane` of `dst`, its
// tile's 3360 bytes for these 256 inputs. Input 128h + 32m + l (group j = 4h + m) has its low 4 bits in nibble
// m / 2 of ql[64h + 32 (m % 2) + l] and its high 2 in bits 2m of qh[32h + l] (GGML's dequantize_row_q6_K).
static void pack_q6_k(const uint8_t* restrict block, int lane, uint8_t* restrict dst) {
    memcpy(dst + 2 * lane, block + 208, 2);
    for (int k = 0; k < 16; k++) dst[32 + 16 * k + lane] = block[192 + k];
    for (int j = 0; j < 8; j++) {
        int h = j / 4, m = j % 4;
        const uint8_t* ql = block + 64 * h + 32 * (m % 2);
        const uint8_t* qh = block + 128 + 32 * h;
        uint8_t* g = dst + 288 + 384 * j;
        for (int c = 0; c < 4; c++)
            store_nibbles(g + 64 * c, lane, load4(ql + 8 * c) >> (4 * (m / 2)), load4(ql + 8 * c + 4) >> (4 * (m / 2)));
        for (int half = 0; half < 2; half++) {  // 2 chunks of the high bits: input 16 half + 4q + b's at bits 2q
            uint32_t bits = 0;
            for (int q = 0; q < 4; q++) bits |= ((load4(qh + 16 * half + 4 * q) >> (2 * m)) & 0x03030303u) << (2 * q);
            store4(g + 256 + 64 * half + 4 * lane, bits);
        }
    }
}

// One output's Q8_0 block (34 bytes: d fp16, 32 int8) into lane `lane` of `dst`, its tile's 544 bytes for these 32
// inputs: chunk k holds inputs 4k .. 4k + 3, each q as the unsigned code q + 128.
static void pack_q8_0(const uint8_t* restrict block, int lane, uint8_t* restrict dst) {
    memcpy(dst + 2 * lane, block, 2);
    for (int k = 0; k < 8; k++) store4(dst + 32 + 64 * k + 4 * lane, load4(block + 2 + 4 * k) ^ 0x80808080u);
}

// One output's Q4_1 block (20 bytes: d and m fp16, 16 bytes of nibbles) into lane `lane` of `dst`, its tile's 320
// bytes for these 32 inputs: d[16], m[16], then 4 chunks of nibbles as a Q4_K group's. Input l + 16h of the block
// is nibble h of qs[l].
static void pack_q4_1(const uint8_t* restrict block, int lane, uint8_t* restrict dst) {
    memcpy(dst + 2 * lane, block, 2);
    memcpy(dst + 32 + 2 * lane, block + 2, 2);
    for (int c = 0; c < 4; c++) {  // chunk c: inputs 8c .. 8c + 7, nibble c / 2 of qs[8 (c % 2) ..]
        const uint8_t* q = block + 4 + 8 * (c % 2);
        int shift = 4 * (c / 2);
        store_nibbles(dst + 64 + 64 * c, lane, load4(q) >> shift, load4(q + 4) >> shift);
    }
}

// Lays out `O` outputs of a GGUF tensor of `I` inputs: output o is the file's row order[o] (order NULL: row o), whose
// blocks start at raw + that row * row_bytes. `packed` holds kquant_tile_bytes(type, I) bytes per tile of 16 outputs,
// zeroed by the caller (a last tile's missing outputs keep zero scales). Returns 0, or -1 for a format or width
// it does not lay out.
int kquant_pack(int type, const uint8_t* raw, long row_bytes, int O, int I, const int64_t* order, uint8_t* packed) {
    int inputs, block_bytes, tile_part;
    void (*one)(const uint8_t*, int, uint8_t*);
    if (type == Q4_K && I % 256 == 0) {
        inputs = 256, block_bytes = 144, tile_part = Q4_K_BYTES, one = pack_q4_k;
    } else if (type == Q6_K && I % 256 == 0) {
        inputs = 256, block_bytes = 210, tile_part = Q6_K_BYTES, one = pack_q6_k;
    } else if (type == Q8_0 && I % 32 == 0) {
        inputs = 32, block_bytes = 34, tile_part = Q8_0_BYTES, one = pack_q8_0;
    } else if (type == Q4_1 && I % 32 == 0) {
        inputs = 32, block_bytes = 20, tile_part = Q4_1_BYTES, one = pack_q4_1;
    } else {
        return -1;
    }
    long tile_bytes = (long)(I / inputs) * tile_part;
    for (int o = 0; o < O; o++) {
        const uint8_t* row = raw + (order ? order[o] : o) * row_bytes;
        uint8_t* tile = packed + (o / TILE) * tile_bytes;
        for (int s = 0; s < I / inputs; s++) one(row + (long)s * block_bytes, o % TILE, tile + (long)s * tile_part);
    }
    return 0;
}
#endif
