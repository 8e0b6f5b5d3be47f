// What the tiled GEMMs (int4_gemm.cl, int8_gemm.cl) share, whatever the weight format: a 16x16 work-group computes
// TM = 16 * TPT tokens x TN = 128 rows, TPT x 8 per thread, from k-major local copies ([kk][token], [kk][row]) of
// KT = 32 columns of x and of the dequantized W at a time. A thread's rows are 4 consecutive ones in each half of
// the tile (tx*4.. and 64 + tx*4..), its tokens likewise (ty*4.., 64 + ty*4..), so it reads them as float4s: two or
// three 16-byte local loads feed 32 or 64 multiply-adds, and the 16 threads of a work-group row read 256
// contiguous bytes of each half, with no bank conflicts. Put before both (kernel_source.py FILE_PRELUDES).

#ifndef TPT
#define TPT 8  // tokens per thread: 4 or 8
#endif
#define TN 128
#define TM (16 * TPT)
#define KT 32

// x's columns k0 .. k0 + KT of the tile's tokens into xsf (k-major); tokens past n and columns past k are zero.
// Consecutive threads take consecutive tokens (conflict-free stores).
inline void gemm_load_x(__global const float* x, int n, int k, int token0, int k0, __local float* xsf, int tid) {
    for (int e = tid; e < TM * 8; e += 256) {
        const int t = e % TM, q = e / TM, token = token0 + t, c = k0 + 4 * q;
        const float4 v = token < n && c < k ? vload4(0, x + (size_t)token * k + c) : (float4)(0.0f);
        xsf[(4 * q) * TM + t] = v.x;
        xsf[(4 * q + 1) * TM + t] = v.y;
        xsf[(4 * q + 2) * TM + t] = v.z;
        xsf[(4 * q + 3) * TM + t] = v.w;
    }
}

// acc (TPT tokens x 8 rows) += the products of one KT-column step of the local copies.
inline void gemm_tile_mac(__local const float4 (*ws)[TN / 4], __local const float4 (*xs)[TM / 4],
                          float acc[TPT][8], int tx, int ty) {
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
}

// The thread's outputs that fall inside (n, m).
inline void gemm_tile_store(float acc[TPT][8], __global float* out, int n, int m, int token0, int row0, int tx,
                            int ty) {
#pragma unroll
    for (int j = 0; j < TPT; ++j) {
        const int token = token0 + (j < 4 ? 4 * ty + j : 64 + 4 * ty + j - 4);
        if (token >= n) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int row = row0 + (i < 4 ? 4 * tx + i : 64 + 4 * tx + i - 4);
            if (row < m) out[(size_t)token * m + row] = acc[j][i];
        }
    }
}
