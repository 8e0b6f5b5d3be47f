// int4 matmuls: out (n, m) = x (n, k) @ W.T for an int4 weight W (m, k), and the int4 embedding gather.
//
// Weight layout on the device (re-packed once at load, runtime.py prepare_weight): "chunk-major".
//   packed: uint4 (k/32, m): element [c][r] holds the 32 codes of row r, columns 32c .. 32c+31. Word j of the
//           uint4 holds columns 32c+8j .. +7, nibble i (bits 4i..4i+3) is column 32c+8j+i: the same 16 bytes
//           as perfx_core.weights packs them, so re-packing is a transpose of 16-byte chunks.
//   scale:  half (k/g, m), read with vload_half so no cl_khr_fp16 is needed;
//   bias:   float (k/g, m).  W[r, c] = code * scale[c/g][r] + bias[c/g][r].
// Why chunk-major: consecutive threads take consecutive rows, so a warp's weight loads are one contiguous
// 512-byte run, and all of them read the same activation chunk (a broadcast), which is what makes decode
// (GEMV) run at memory bandwidth. k is a multiple of the group size g (32, 64 or 128), so a chunk never
// spans two groups.
// Activation tensor arguments are (pointer, element offset) pairs: views are offsets, not sub-buffers.

#ifndef NT
#define NT 1  // tokens multiplied per pass over the weights (batched decode: n <= NT)
#endif
#ifndef RW
#define RW 32  // rows per work-group (local dimension 0)
#endif
#ifndef KS
#define KS 8  // threads splitting one row's chunks (local dimension 1)
#endif


#ifdef X_IMAGE
// Adreno: activations through the texture path (image1d_buffer_t over the same buffer, one float per texel).
#define X_ARG __read_only image1d_buffer_t x
#define LOAD_X8(base)                                                                                     \
    (float8)(read_imagef(x, (base)).x, read_imagef(x, (base) + 1).x, read_imagef(x, (base) + 2).x,      \
             read_imagef(x, (base) + 3).x, read_imagef(x, (base) + 4).x, read_imagef(x, (base) + 5).x,  \
             read_imagef(x, (base) + 6).x, read_imagef(x, (base) + 7).x)
#else
#define X_ARG __global const float* x
#define LOAD_X8(base) vload8(0, x + (base))
#endif

inline float8 codes8(uint w) {
    return (float8)((float)(w & 15u), (float)((w >> 4) & 15u), (float)((w >> 8) & 15u), (float)((w >> 12) & 15u),
                    (float)((w >> 16) & 15u), (float)((w >> 20) & 15u), (float)((w >> 24) & 15u),
                    (float)(w >> 28));
}

inline float dot8(float8 a, float8 b) { return dot(a.lo, b.lo) + dot(a.hi, b.hi); }

inline float sum8(float8 v) { return dot(v.lo + v.hi, (float4)(1.0f)); }

// acc[t] += chunk c (codes w, scale s, bias b) dotted with token t's activations: sum(x * (q*s + b)) over a
// chunk is s * dot(q, x) + b * sum(x).
inline void accumulate_chunk(uint4 w, float s, float b, X_ARG, int x_off, int c, int n, int k, float* acc) {
    const float8 q0 = codes8(w.s0), q1 = codes8(w.s1), q2 = codes8(w.s2), q3 = codes8(w.s3);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
            const int base = x_off + t * k + (c << 5);
            const float8 x0 = LOAD_X8(base), x1 = LOAD_X8(base + 8), x2 = LOAD_X8(base + 16), x3 = LOAD_X8(base + 24);
            const float d = dot8(q0, x0) + dot8(q1, x1) + dot8(q2, x2) + dot8(q3, x3);
            acc[t] += s * d + b * sum8(x0 + x1 + x2 + x3);
        }
    }
}

// acc[t] += row `row` dotted with token t (t < n <= NT), over the chunks split, split + KS, ... Two chunks are
// loaded before either is used, so each thread keeps two 16-byte loads in flight (memory-level parallelism
// is what a GEMV needs to reach the memory bandwidth).
inline void accumulate_row(__global const uint4* packed, __global const half* scale, __global const float* bias,
                           X_ARG, int x_off, int row, int m, int n, int k, int group_shift, int split, float* acc) {
    const int chunks = k >> 5;
    int c = split;
    for (; c + KS < chunks; c += 2 * KS) {
        const uint4 w0 = packed[(size_t)c * m + row], w1 = packed[(size_t)(c + KS) * m + row];
        const size_t g0 = (size_t)((c << 5) >> group_shift) * m + row;
        const size_t g1 = (size_t)(((c + KS) << 5) >> group_shift) * m + row;
        const float s0 = vload_half(g0, scale), b0 = bias[g0], s1 = vload_half(g1, scale), b1 = bias[g1];
        accumulate_chunk(w0, s0, b0, x, x_off, c, n, k, acc);
        accumulate_chunk(w1, s1, b1, x, x_off, c + KS, n, k, acc);
    }
    if (c < chunks) {
        const size_t g = (size_t)((c << 5) >> group_shift) * m + row;
        accumulate_chunk(packed[(size_t)c * m + row], vload_half(g, scale), bias[g], x, x_off, c, n, k, acc);
    }
}

// Sums the KS partial sums of every (row, token) of the work-group; thread (lr, split = 0) gets its row's.
inline void reduce_splits(__local float (*partial)[RW][NT], float* acc, int lr, int split) {
#pragma unroll
    for (int t = 0; t < NT; ++t) partial[split][lr][t] = acc[t];
    barrier(CLK_LOCAL_MEM_FENCE);
    if (split == 0) {
        for (int i = 1; i < KS; ++i) {
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[t] += partial[i][lr][t];
        }
    }
}

// out (n, m) = x (n, k) @ W.T for n <= NT. Global size (ceil(m / RW) * RW, KS), local (RW, KS).
__kernel __attribute__((reqd_work_group_size(RW, KS, 1))) void int4_gemv(
    __global const uint4* packed, __global const half* scale, __global const float* bias, X_ARG, int x_off,
    __global float* out, int out_off, int n, int m, int k, int group_shift) {
    __local float partial[KS][RW][NT];
    const int lr = get_local_id(0), split = get_local_id(1), row = get_global_id(0);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    if (row < m) accumulate_row(packed, scale, bias, x, x_off, row, m, n, k, group_shift, split, acc);
    reduce_splits(partial, acc, lr, split);
    if (split == 0 && row < m) {
        for (int t = 0; t < n && t < NT; ++t) out[out_off + (size_t)t * m + row] = acc[t];
    }
}

// Fused gate|up GEMV and SwiGLU for W = [W_gate; W_up] (2f, k), n <= NT:
// out (n, f) = silu(x @ W_gate.T) * (x @ W_up.T). Global size (ceil(f / RW) * RW, KS), local (RW, KS).
__kernel __attribute__((reqd_work_group_size(RW, KS, 1))) void int4_gemv_silu(
    __global const uint4* packed, __global const half* scale, __global const float* bias, X_ARG, int x_off,
    __global float* out, int out_off, int n, int f, int k, int group_shift) {
    __local float partial[KS][RW][NT];
    const int lr = get_local_id(0), split = get_local_id(1), col = get_global_id(0);
    float gate[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) gate[t] = up[t] = 0.0f;
    if (col < f) {
        accumulate_row(packed, scale, bias, x, x_off, col, 2 * f, n, k, group_shift, split, gate);
        accumulate_row(packed, scale, bias, x, x_off, f + col, 2 * f, n, k, group_shift, split, up);
    }
    reduce_splits(partial, gate, lr, split);
    barrier(CLK_LOCAL_MEM_FENCE);
    reduce_splits(partial, up, lr, split);
    if (split == 0 && col < f) {
        for (int t = 0; t < n && t < NT; ++t) {
            const float g = gate[t];
            out[out_off + (size_t)t * f + col] = g / (1.0f + exp(-g)) * up[t];
        }
    }
}

// Tiled int4 GEMM for prefill: a 16x16 work-group computes a 64 (tokens) x TR (rows) block of out, 4 x RPT
// per thread (TR = 16 * RPT), so each value read from local memory feeds several multiply-adds. Each k step
// stages one chunk (32 columns) of x and of the dequantized weights in local memory.
// Global size (m / RPT, n / 4) rounded up to whole work-groups.
#ifndef RPT
#define RPT 4  // rows per thread
#endif
#define TT 64  // tokens per work-group
#define TR (16 * RPT)  // rows per work-group
#define KT 32
__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void int4_gemm(
    __global const uint* packed, __global const half* scale, __global const float* bias, __global const float* x,
    int x_off, __global float* out, int out_off, int n, int m, int k, int group_shift) {
    __local float xs[TT][KT + 1];  // [token][kk], +1 against bank conflicts
    __local float ws[TR][KT + 1];  // [row][kk]
    const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
    const int row0 = get_group_id(0) * TR, token0 = get_group_id(1) * TT;
    float acc[4][RPT];
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < RPT; ++i) acc[j][i] = 0.0f;
    for (int k0 = 0; k0 < k; k0 += KT) {
        for (int e = tid; e < TT * KT; e += 256) {
            const int t = e / KT, kk = e % KT, token = token0 + t;
            xs[t][kk] = token < n ? x[x_off + token * k + k0 + kk] : 0.0f;
        }
        // TR rows x 4 words of the chunk: consecutive threads read consecutive words (8 codes each).
        for (int e = tid; e < TR * 4; e += 256) {
            const int r = e >> 2, word = e & 3, row = row0 + r;
            if (row < m) {
                const uint w = packed[((size_t)(k0 >> 5) * m + row) * 4 + word];
                const size_t g = (size_t)(k0 >> group_shift) * m + row;
                const float s = vload_half(g, scale), b = bias[g];
                for (int j = 0; j < 8; ++j) ws[r][word * 8 + j] = (float)((w >> (4 * j)) & 15u) * s + b;
            } else {
                for (int j = 0; j < 8; ++j) ws[r][word * 8 + j] = 0.0f;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < KT; ++kk) {
            float a[4], b[RPT];
            for (int j = 0; j < 4; ++j) a[j] = xs[ty + 16 * j][kk];
            for (int i = 0; i < RPT; ++i) b[i] = ws[tx + 16 * i][kk];
            for (int j = 0; j < 4; ++j)
                for (int i = 0; i < RPT; ++i) acc[j][i] += a[j] * b[i];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int j = 0; j < 4; ++j) {
        const int t = token0 + ty + 16 * j;
        for (int i = 0; i < RPT; ++i) {
            const int r = row0 + tx + 16 * i;
            if (t < n && r < m) out[out_off + t * m + r] = acc[j][i];
        }
    }
}

// Rows ids[i] of an int4 table (vocab, d) in the chunk-major layout, dequantized: global size (d, n).
__kernel void embedding_int4(__global const uchar* packed, __global const half* scale, __global const float* bias,
                             __global const int* ids, __global float* out, int out_off, int vocab, int d,
                             int group_shift) {
    const int c = get_global_id(0), i = get_global_id(1);
    if (c >= d) return;
    const size_t row = (size_t)ids[i];
    const uchar byte = packed[((size_t)(c >> 5) * vocab + row) * 16 + ((c & 31) >> 1)];
    const float code = (float)((c & 1) ? (byte >> 4) : (byte & 15));
    const size_t g = (size_t)(c >> group_shift) * vocab + row;
    out[out_off + i * d + c] = code * vload_half(g, scale) + bias[g];
}
