// int8 matmuls on matrix units: out (n, rows) = x (n, k) @ W.T with W in int8_weight.cl's int8 form (an int6 or Q5_0
// weight expanded to it: int8.cl to_int8), for prompts (the GEMV takes up to 64 tokens).
//
// int4_mma.cl's scheme (warps of MT 16-row x NT8 8-token tiles, mma m16n8k16 through mma.cl, KW warps splitting
// k) with a 16-column chunk as one k16 step. Fragments, for lane = 4 * g + t: lane t takes word t of each row's
// chunk (columns 16c + 4t .. 4t+3) and maps logical k (2t, 2t+1) onto its bytes 0, 1 and (2t+8, 2t+9) onto bytes
// 2, 3; its x are columns 16c + 4t .. 4t+3 of token g, paired the same way. A byte pair becomes two halves without
// a conversion instruction: each byte u = code + 128 (chunk_word) masked into the low bits of a half 0x6400
// (1024 + u) and 1152 subtracted leaves the code, exact in half.
//
// The scale stays out of the half arithmetic: each chunk's products are summed by the matrix unit in float32 and
// then multiplied by the row's float scale (GGUF Q6_K's d * sc is exact only in float32), so only x is rounded,
// to half. Global size (ceil(rows / (16 * MT)) * 32 * KW, ceil(n / (8 * NT8))), local (32 * KW, 1).

#ifndef MT
#define MT 2
#endif
#ifndef NT8
#define NT8 2
#endif
#ifndef KW
#define KW 4
#endif

#ifdef X_UNALIGNED
#define LOAD_X4(i) vload4(0, x + (i))
#else
#define LOAD_X4(i) (*(__global const float4*)(x + (i)))  // the host passes x_off % 4 == 0
#endif

#if CODE_OFFSET != 128
#error "int8_mma takes the int8 form: the host expands an int6 or Q5_0 weight to it first (int8.cl to_int8)"
#endif

// Bytes 0, 1 (high = 0) or 2, 3 (high = 1) of a word of offset bytes as the halves 1024 + code + 128.
inline uint byte_pair(uint w, int high) {
    const uint u = w >> (16 * high);
    return (u & 0xFFu) | ((u << 8) & 0xFF0000u) | 0x64006400u;
}

#ifdef NV_MMA
inline uint codes_of(uint pair) {
    uint q;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(pair), "r"(0x64806480u));  // minus 1152 in each half
    return q;
}
#else
inline uint codes_of(uint pair) { return half2_of(half_value(pair) - 1152.0f, half_value(pair >> 16) - 1152.0f); }
#endif

__kernel __attribute__((reqd_work_group_size(32 * KW, 1, 1))) void int8_mma(
    BYTE_WEIGHT_PARAMS, __global const float* x, int x_off, __global float* out, int out_off, int n, int rows, int k,
    int group_shift) {
    BYTE_WEIGHT_AT;
    const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = get_group_id(0) * 16 * MT, token0 = get_group_id(1) * 8 * NT8;
    // This lane's weight rows (g and g + 8 of each tile) and x rows (token g of each tile), clamped into range:
    // the extra rows and tokens are computed and never stored, so every lane runs the same loop.
    int wrow[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) wrow[i][h] = min(row0 + 16 * i + g + 8 * h, rows - 1);
    int xrow[NT8];
#pragma unroll
    for (int j = 0; j < NT8; ++j) xrow[j] = x_off + min(token0 + 8 * j + g, n - 1) * k + 4 * t;

    float acc[MT][NT8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
#ifndef NV_MMA
    __local float scratch_tiles[KW][MMA_SCRATCH];
    __local float* const mma_scratch = scratch_tiles[warp];  // the emulated MMA's tiles (mma.cl)
#endif
    const int per_warp = (k >> 4) / KW, c_begin = warp * per_warp, c_end = c_begin + per_warp;
    for (int c = c_begin; c < c_end; ++c) {
        uint w[MT][2];
        float s[MT][2];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                w[i][h] = chunk_word(BYTE_WEIGHT, c, wrow[i][h], rows, t);
                s[i][h] = chunk_factors(BYTE_WEIGHT, c, wrow[i][h], rows, group_shift).x;
            }
        uint bx[NT8][2];
#pragma unroll
        for (int j = 0; j < NT8; ++j) {
            const float4 v = LOAD_X4(xrow[j] + 16 * c);
            bx[j][0] = half2_of(v.x, v.y), bx[j][1] = half2_of(v.z, v.w);
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const uint a0 = codes_of(byte_pair(w[i][0], 0)), a1 = codes_of(byte_pair(w[i][1], 0));
            const uint a2 = codes_of(byte_pair(w[i][0], 1)), a3 = codes_of(byte_pair(w[i][1], 1));
#pragma unroll
            for (int j = 0; j < NT8; ++j) {
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                MMA(part, a0, a1, a2, a3, bx[j][0], bx[j][1]);
                acc[i][j][0] = fma(s[i][0], part[0], acc[i][j][0]);
                acc[i][j][1] = fma(s[i][0], part[1], acc[i][j][1]);
                acc[i][j][2] = fma(s[i][1], part[2], acc[i][j][2]);
                acc[i][j][3] = fma(s[i][1], part[3], acc[i][j][3]);
            }
        }
    }
#if KW > 1
    __local float partial[KW - 1][MT * NT8 * 4][32];  // warps 1.. hand their sums to warp 0
    if (warp > 0)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) partial[warp - 1][(i * NT8 + j) * 4 + e][lane] = acc[i][j][e];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (warp > 0) return;
    for (int v = 0; v < KW - 1; ++v)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] += partial[v][(i * NT8 + j) * 4 + e][lane];
#endif
    // Output e of tile (i, j): row 16i + g (+8 for e >= 2), token 8j + 2t (+1 for odd e).
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + 16 * i + g + 8 * (e >> 1), token = token0 + 8 * j + 2 * t + (e & 1);
                if (row < rows && token < n) out[out_off + (size_t)token * rows + row] = acc[i][j][e];
            }
}
