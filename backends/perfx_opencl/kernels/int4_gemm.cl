// Tiled int4 GEMM for prefill and other n > 16: out (n, m) = x (n, k) @ W.T, W in int4.cl's chunk-major
// layout (packed uint4 (k/32, m), half scale and float bias (k/g, m)).
//
// A 16x16 work-group computes a tile of TM = 16 * TPT tokens x TN = 128 rows, TPT x 8 per thread, from
// local-memory copies of one 32-column chunk of x and of the dequantized W at a time. Both copies are
// k-major ([kk][token], [kk][row]), so a thread reads its 8 rows and 4 or 8 tokens as float4s: two or
// three 16-byte local loads feed 32 or 64 multiply-adds (the previous kernel read scalars: 12 loads for 32).
// A thread's rows are 4 consecutive ones in each half of the tile (tx*4.. and 64 + tx*4..), so the 16
// threads of a row of the work-group read 256 contiguous bytes of each half, with no bank conflicts.
// Global size (ceil(m / 128) * 16, ceil(n / TM) * 16), local (16, 16).

#ifndef TPT
#define TPT 8  // tokens per thread: 4 or 8
#endif
#define TN 128
#define TM (16 * TPT)
#define KT 32

__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void int4_gemm(
    __global const uint4* packed, __global const half* scale, __global const float* bias, __global const float* x,
    int x_off, __global float* out, int out_off, int n, int m, int k, int group_shift) {
    __local float4 ws[KT][TN / 4];  // dequantized weights of the chunk, [kk][row]
    __local float4 xs[KT][TM / 4];  // the chunk of x, [kk][token]
    const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
    const int row0 = get_group_id(0) * TN, token0 = get_group_id(1) * TM;
    float acc[TPT][8];
#pragma unroll
    for (int j = 0; j < TPT; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;

    __local float* wsf = (__local float*)ws;
    __local float* xsf = (__local float*)xs;
    for (int k0 = 0; k0 < k; k0 += KT) {
        const int c = k0 >> 5;
        // Weights: threads 0..127 take one row's 16-byte chunk each (one coalesced 2 KB read), dequantize its
        // 32 codes and store them down column `tid` (consecutive threads, consecutive banks).
        if (tid < TN) {
            const int row = row0 + tid;
            float v[32];
            if (row < m) {
                const uint4 w = packed[(size_t)c * m + row];
                const size_t g = (size_t)(k0 >> group_shift) * m + row;
                const float s = vload_half(g, scale), b = GROUP_BIAS(bias, g, s);
                const uint words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int word = 0; word < 4; ++word)
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[8 * word + i] = (float)((words[word] >> (4 * i)) & 15u) * s + b;
            } else {
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) v[kk] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) wsf[kk * TN + tid] = v[kk];
        }
        // x: TM tokens x 8 float4s; consecutive threads take consecutive tokens (conflict-free stores).
        for (int e = tid; e < TM * 8; e += 256) {
            const int t = e % TM, q = e / TM, token = token0 + t;
            const float4 v = token < n ? vload4(0, x + x_off + (size_t)token * k + k0 + 4 * q) : (float4)(0.0f);
            xsf[(4 * q) * TM + t] = v.x;
            xsf[(4 * q + 1) * TM + t] = v.y;
            xsf[(4 * q + 2) * TM + t] = v.z;
            xsf[(4 * q + 3) * TM + t] = v.w;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll 8
        for (int kk = 0; kk < KT; ++kk) {
            const float4 b0 = ws[kk][tx], b1 = ws[kk][16 + tx];
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            float a[TPT];
            const float4 a0 = xs[kk][ty];
            a[0] = a0.x, a[1] = a0.y, a[2] = a0.z, a[3] = a0.w;
#if TPT == 8
            const float4 a1 = xs[kk][16 + ty];
            a[4] = a1.x, a[5] = a1.y, a[6] = a1.z, a[7] = a1.w;
#endif
#pragma unroll
            for (int j = 0; j < TPT; ++j)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[j][i] = fma(a[j], b[i], acc[j][i]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    // Token j of the thread is ty*4 + j (j < 4) or 64 + ty*4 + j-4; row i is tx*4 + i or 64 + tx*4 + i-4.
#pragma unroll
    for (int j = 0; j < TPT; ++j) {
        const int token = token0 + (j < 4 ? 4 * ty + j : 64 + 4 * ty + j - 4);
        if (token >= n) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int row = row0 + (i < 4 ? 4 * tx + i : 64 + 4 * tx + i - 4);
            if (row < m) out[out_off + (size_t)token * m + row] = acc[j][i];
        }
    }
}
