// Tiled int8 GEMM for n > 64 tokens: out (n, m) = x (n, k) @ W.T, W in int8_weight.cl's chunk-major layout. The
// scheme of int4_gemm.cl: a 16x16 work-group computes TM = 16 * TPT tokens x TN = 128 rows, TPT x 8 per thread,
// from k-major local copies of 32 columns of x and of the dequantized W at a time (two 16-column chunks: the 256
// threads load 128 rows x 2 chunks, one 16-byte chunk each). k is a multiple of 16; a last half step past k reads
// zeros. Global size (ceil(m / 128) * 16, ceil(n / TM) * 16), local (16, 16).

#ifndef TPT
#define TPT 8  // tokens per thread: 4 or 8
#endif
#define TN 128
#define TM (16 * TPT)
#define KT 32

__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void int8_gemm(
    __global const uint4* codes, __global const SCALE_T* scale, __global const float* x, int x_off,
    __global float* out, int out_off, int n, int m, int k, int group_shift) {
    __local float4 ws[KT][TN / 4];  // dequantized weights, [kk][row]
    __local float4 xs[KT][TM / 4];  // x, [kk][token]
    const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
    const int row0 = get_group_id(0) * TN, token0 = get_group_id(1) * TM;
    const int chunks = k >> 4;
    float acc[TPT][8];
#pragma unroll
    for (int j = 0; j < TPT; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;

    __local float* wsf = (__local float*)ws;
    __local float* xsf = (__local float*)xs;
    for (int k0 = 0; k0 < k; k0 += KT) {
        // Weights: thread tid takes chunk k0/16 + tid/128 of row tid % 128 (consecutive threads, consecutive rows:
        // coalesced reads and conflict-free local stores down the columns).
        {
            const int r = tid % TN, part = tid / TN, c = (k0 >> 4) + part, row = row0 + r;
            float4 wv[4] = {(float4)(0.0f), (float4)(0.0f), (float4)(0.0f), (float4)(0.0f)};
            if (row < m && c < chunks)
                dequantize_chunk8(codes[(size_t)c * m + row],
                                  LOAD_SCALE((size_t)((c << 4) >> group_shift) * m + row, scale), wv);
            const int kk = 16 * part;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                wsf[(kk + 4 * j) * TN + r] = wv[j].x;
                wsf[(kk + 4 * j + 1) * TN + r] = wv[j].y;
                wsf[(kk + 4 * j + 2) * TN + r] = wv[j].z;
                wsf[(kk + 4 * j + 3) * TN + r] = wv[j].w;
            }
        }
        // x: TM tokens x 8 float4s; consecutive threads take consecutive tokens.
        for (int e = tid; e < TM * 8; e += 256) {
            const int t = e % TM, q = e / TM, token = token0 + t, c = k0 + 4 * q;
            const float4 v = token < n && c < k ? vload4(0, x + x_off + (size_t)token * k + c) : (float4)(0.0f);
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
