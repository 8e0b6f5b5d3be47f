// int4 matmuls on matrix units: out (n, rows) = x (n, k) @ W.T with W in int4.cl's chunk-major layout
// (packed uint4 (k/32, m), half scale and float bias (k/g, m)), for batched decode and prefill.
//
// Each warp (32 consecutive work-items) runs mma m16n8k16 (f16 inputs, f32 accumulation) over MT tiles of 16
// weight rows x NT8 tiles of 8 tokens, through mma.cl (mma.sync on NVIDIA, a portable emulation elsewhere).
//
// Why this beats the integer-dot GEMV from a few tokens on: a GEMV over 16 tokens spends 16 multiply-adds per
// weight on FP32 or dp4a units, which made it arithmetic-bound (H200 12288x4096: 86.9 us at 16 tokens vs 13.4
// at one); the matrix units do them at a small fraction of that cost, so W is read at close to memory speed.
//
// Fragments. For lane = 4 * g + t, mma m16n8k16 wants A (weights) rows g and g + 8 at k = 2t, 2t+1, 2t+8,
// 2t+9 and B (activations) at the same k for token g. The sum over k does not care about its order, so the
// kernel maps those logical k onto physical columns where they are cheap to get: lane t takes word t of each
// row's 16-byte chunk (columns 32c + 8t .. 8t+7, nibble i = column 8t+i) and, for the chunk's two k16 steps
// s = 0, 1, logical (2t, 2t+1) = nibbles (2s, 2s+4) and (2t+8, 2t+9) = nibbles (2s+1, 2s+5). The pair
// (nibble j, nibble j+4) of word w is ((w >> 4j) & 0x000F000F): two codes in the low bits of two halves,
// which OR 0x6400 turns into the halves 1024 + code (no conversion instruction). Its x are the 8 floats of
// columns 32c + 8t .. 8t+7 paired the same way: (x0, x4), (x1, x5), (x2, x6), (x3, x7).
//
// Dequantization is in half: w = code * scale + bias (one subtract and one fma per two weights), as GPU AWQ
// kernels do; x is rounded to half too. Both round to 11 bits (relative error 2^-12), far inside the engine's
// 1e-4 logits NMSE bar. |x| beyond 65504 (half's range) would overflow: not seen in Llama-family inputs.
//
// Work split: a work-group is KW warps over the same MT x 16 rows and NT8 x 8 tokens, warp w taking the w-th
// of KW equal runs of chunks (the host keeps KW a divisor of k / 32), summed through local memory at the end.
// Global size (ceil(rows / (16 * MT)) * 32 * KW, ceil(n / (8 * NT8))), local (32 * KW, 1).
// SILU: W is [W_gate; W_up] (2 * rows rows) and out = silu(x @ W_gate.T) * (x @ W_up.T); SILU and GELU: gelu_tanh.
// ADD_NORM (not with SILU): linear_add_rmsnorm's residual add and RMSNorm after the matmul (add_norm_tail.cl).

#ifndef MT
#define MT 2  // 16-row weight tiles per warp
#endif
#ifndef NT8
#define NT8 2  // 8-token tiles per warp
#endif
#ifndef KW
#define KW 4  // warps per work-group, splitting k
#endif
#ifndef GROUP_CHUNKS  // 32-column chunks per quantization group (group size / 32: 1, 2 or 4), from the host
#error "int4_mma needs -DGROUP_CHUNKS"
#endif
#ifndef UC
#define UC 1  // chunks whose weights a warp loads before multiplying any: more bytes in flight per warp
#endif
#if defined(Q4_K_FACTORS) && GROUP_CHUNKS != 1
#error "Q4_K's groups are 32 columns, one chunk"
#endif
#if GROUP_CHUNKS % UC
#error "UC must divide GROUP_CHUNKS: a run of UC chunks (starting at a multiple of UC) then has one group"
#endif
#if defined(SILU) && defined(ADD_NORM)
#error "ADD_NORM takes a plain matmul"
#endif
#ifdef SILU
#define RT (2 * MT)  // accumulated row tiles: the gate tiles, then the matching up tiles
#else
#define RT MT
#endif

#ifdef X_UNALIGNED
#define LOAD_X4(i) vload4(0, x + (i))
#else
#define LOAD_X4(i) (*(__global const float4*)(x + (i)))  // the host passes x_off % 4 == 0
#endif

#define CODE_PAIR(w, shift) ((((w) >> (shift)) & 0x000F000Fu) | 0x64006400u)  // halves 1024 + code

#ifdef NV_MMA
// (1024 + code) pairs -> code * scale + bias, per half.
inline uint dequantize_pair(uint codes, uint scale2, uint bias2) {
    uint q, r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(q) : "r"(codes), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(scale2), "r"(bias2));
    return r;
}
#else
// Portable: the same roundings through mma.cl's half helpers.
inline uint dequantize_pair(uint codes, uint scale2, uint bias2) {
    const float lo = fma(half_value(codes) - 1024.0f, half_value(scale2), half_value(bias2));
    const float hi = fma(half_value(codes >> 16) - 1024.0f, half_value(scale2 >> 16), half_value(bias2 >> 16));
    return half2_of(lo, hi);
}
#endif

#ifdef NV_MMA
typedef int mma_scratch_t;  // mma.sync needs no scratch
#else
typedef __local float* mma_scratch_t;
#if UC != 1
#error "the emulation's barriers need every warp to multiply its chunks at the same call site: UC must be 1"
#endif
#endif

// x's 32 columns of chunk c for this lane's tokens, as the half pairs the B fragments want.
inline void load_x_chunk(uint bx[NT8][4], __global const float* x, const int xrow[NT8], int c) {
#pragma unroll
    for (int j = 0; j < NT8; ++j) {
        const float4 lo = LOAD_X4(xrow[j] + 32 * c), hi = LOAD_X4(xrow[j] + 32 * c + 4);
        bx[j][0] = half2_of(lo.x, hi.x), bx[j][1] = half2_of(lo.y, hi.y);
        bx[j][2] = half2_of(lo.z, hi.z), bx[j][3] = half2_of(lo.w, hi.w);
    }
}

// This lane's word of chunk c for each of its weight rows.
inline void load_w_chunk(uint w[RT][2], __global const uint* packed, const int wrow[RT][2], int c, int m, int t) {
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) w[i][h] = packed[((size_t)c * m + wrow[i][h]) * 4 + t];
}

#if defined(Q4_K_FACTORS) && defined(NV_MMA)
inline uint byte_perm(uint a, uint b, uint selector) {
    uint r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// A Q4_K group's (d * sc, -dmin * m) as halves in one f16x2 multiply (int4_group.cl keeps -dmin), with byte
// permutes around it: no conversions (quarter-rate on NVIDIA) and few instructions, since every lane does this
// per row and chunk (with int4_group's float32 products a 7B Q4_K_M's prefill ran at 6.7k tok/s on the H100, not
// 9.9k). Each product is exact in float32, so the multiply's one rounding to half is what rounding it would give.
inline void load_group(uint scale2[RT][2], uint bias2[RT][2], __global const ushort* scale,
                       __global const float* bias, const int wrow[RT][2], int c, int m) {
    __global const ushort* sc_m = scale + (size_t)c * m;  // groups are chunks
    __global const uint* d_dmin = (__global const uint*)bias + (size_t)(c >> 3) * m;
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint codes = byte_perm(sc_m[wrow[i][h]], 0x64006400u, 0x7150u);  // halves 1024 + sc, 1024 + m
            uint factors, products;
            asm("sub.f16x2 %0, %1, %2;" : "=r"(factors) : "r"(codes), "r"(0x64006400u));
            asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(products) : "r"(d_dmin[wrow[i][h]]), "r"(factors));
            scale2[i][h] = byte_perm(products, 0u, 0x1010u);
            bias2[i][h] = byte_perm(products, 0u, 0x3232u);
        }
}
#else
// The scales and biases of the group holding chunk c, as half pairs.
inline void load_group(uint scale2[RT][2], uint bias2[RT][2], __global const ushort* scale,
                       __global const float* bias, const int wrow[RT][2], int c, int m) {
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 f = int4_group(scale, bias, c / GROUP_CHUNKS, wrow[i][h], m);
            scale2[i][h] = half2_of(f.x, f.x);
            bias2[i][h] = half2_of(f.y, f.y);
        }
}
#endif

// acc += one chunk: its two k16 steps over every row tile and token tile.
inline void multiply_chunk(float acc[RT][NT8][4], const uint w[RT][2], const uint bx[NT8][4],
                           const uint scale2[RT][2], const uint bias2[RT][2], mma_scratch_t mma_scratch, int lane) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int i = 0; i < RT; ++i) {
            const uint a0 = dequantize_pair(CODE_PAIR(w[i][0], 8 * s), scale2[i][0], bias2[i][0]);
            const uint a1 = dequantize_pair(CODE_PAIR(w[i][1], 8 * s), scale2[i][1], bias2[i][1]);
            const uint a2 = dequantize_pair(CODE_PAIR(w[i][0], 8 * s + 4), scale2[i][0], bias2[i][0]);
            const uint a3 = dequantize_pair(CODE_PAIR(w[i][1], 8 * s + 4), scale2[i][1], bias2[i][1]);
#pragma unroll
            for (int j = 0; j < NT8; ++j) MMA(acc[i][j], a0, a1, a2, a3, bx[j][2 * s], bx[j][2 * s + 1]);
        }
}

__kernel __attribute__((reqd_work_group_size(32 * KW, 1, 1))) void int4_mma(
    INT4_WEIGHT_PARAMS(uint, ushort), __global const float* x, int x_off, __global float* out, int out_off, int n,
    int rows, int k EPILOGUE_ARGS) {
    INT4_WEIGHT_AT(uint);
#ifndef NV_MMA
    __local float mma_scratch[KW][MMA_SCRATCH];
#endif
    const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = get_group_id(0) * 16 * MT, token0 = get_group_id(1) * 8 * NT8;
#ifdef SILU
    const int m = 2 * rows;
#else
    const int m = rows;
#endif
    // This lane's weight rows (g and g + 8 of each tile) and x rows (token g of each tile), clamped into
    // range: the extra rows and tokens are computed and never stored, so every lane runs the same loop.
    int wrow[RT][2];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(row0 + 16 * (i % MT) + g + 8 * h, rows - 1);
            wrow[i][h] = i < MT ? r : rows + r;
        }
    int xrow[NT8];
#pragma unroll
    for (int j = 0; j < NT8; ++j) xrow[j] = x_off + min(token0 + 8 * j + g, n - 1) * k + 8 * t;

    float acc[RT][NT8][4];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int j = 0; j < NT8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    // Chunks one by one up to a multiple of UC, then runs of UC (all their weights loaded before the first is
    // multiplied, so each warp has UC times the bytes in flight: decode-sized launches have few warps), then
    // one by one to the end. (At 512 tokens, loading chunk c + 1 before multiplying chunk c was slower on the
    // H200, 359 vs 275 us, from the registers it takes; small token tiles leave registers to spare.)
    const int per_warp = (k >> 5) / KW, c_begin = warp * per_warp, c_end = c_begin + per_warp;
    const int run_begin = min(c_end, (c_begin + UC - 1) / UC * UC);
    const int run_end = run_begin + (c_end - run_begin) / UC * UC;
#ifdef NV_MMA
    const mma_scratch_t scratch = 0;
#else
    const mma_scratch_t scratch = mma_scratch[warp];
#endif
    uint scale2[RT][2], bias2[RT][2], w[UC][RT][2], bx[NT8][4];
    for (int c = c_begin; c < c_end;) {
        // A new group: its scales and biases (a run starts at a multiple of UC, a divisor of GROUP_CHUNKS, so it
        // never straddles two groups).
        if (c == c_begin || c % GROUP_CHUNKS == 0) load_group(scale2, bias2, scale, bias, wrow, c, m);
        if (c >= run_begin && c < run_end) {
#pragma unroll
            for (int u = 0; u < UC; ++u) load_w_chunk(w[u], packed, wrow, c + u, m, t);
#pragma unroll
            for (int u = 0; u < UC; ++u) {
                load_x_chunk(bx, x, xrow, c + u);
                multiply_chunk(acc, w[u], bx, scale2, bias2, scratch, lane);
            }
            c += UC;
        } else {  // never in the emulation (UC = 1): its barriers stay at one call site
            load_w_chunk(w[0], packed, wrow, c, m, t);
            load_x_chunk(bx, x, xrow, c);
            multiply_chunk(acc, w[0], bx, scale2, bias2, scratch, lane);
            ++c;
        }
    }

#if KW > 1
    // Warps 1.. hand their sums to warp 0 (lane-minor: conflict-free).
    __local float partial[KW - 1][RT * NT8 * 4][32];
    if (warp > 0)
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) partial[warp - 1][(i * NT8 + j) * 4 + e][lane] = acc[i][j][e];
    barrier(CLK_LOCAL_MEM_FENCE);
#ifndef ADD_NORM
    if (warp > 0) return;
#endif
    if (warp == 0)
        for (int v = 0; v < KW - 1; ++v)
#pragma unroll
            for (int i = 0; i < RT; ++i)
#pragma unroll
                for (int j = 0; j < NT8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] += partial[v][(i * NT8 + j) * 4 + e][lane];
#endif
    // Output e of tile (i, j): row 16i + g (+8 for e >= 2), token 8j + 2t (+1 for odd e).
    if (warp == 0)  // (with ADD_NORM the other warps are still here, for the tail)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + 16 * i + g + 8 * (e >> 1), token = token0 + 8 * j + 2 * t + (e & 1);
                    if (row >= rows || token >= n) continue;
#ifdef SILU
                    const float gate = acc[i][j][e];
                    const float v = GATE_ACTIVATION(gate) * acc[MT + i][j][e];
#else
                    const float v = acc[i][j][e];
#endif
                    out[out_off + (size_t)token * rows + row] = v;
                }
#ifdef ADD_NORM
    __local float norm_scratch[32 * KW];
    __local int ticket;
    add_norm_tail(out + out_off, POST_W, residual + residual_off, norm_w + norm_w_off, normed + normed_off, n,
                  rows, eps, counter + counter_off, finishers, norm_scratch, &ticket, get_local_id(0), 32 * KW);
#endif
}
