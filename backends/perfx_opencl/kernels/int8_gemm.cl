// Tiled GEMM of a byte-decoded weight for n > 64 tokens: out (n, m) = x (n, k) @ W.T, W an int8_weight.cl form. The
// tile is gemm_tile.cl's, 32 columns of x and of the dequantized W at a time (two 16-column chunks: the 256 threads
// load 128 rows x 2 chunks, one 16-byte chunk each). k is a multiple of 16; a last half step past k reads zeros.
// Global size (ceil(m / 128) * 16, ceil(n / TM) * 16), local (16, 16).

__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void int8_gemm(
    BYTE_WEIGHT_PARAMS, __global const float* x, int x_off, __global float* out, int out_off, int n, int m, int k,
    int group_shift) {
    BYTE_WEIGHT_AT;
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
                dequantize_chunk8(chunk_words(BYTE_WEIGHT, c, row, m),
                                  chunk_factors(BYTE_WEIGHT, c, row, m, group_shift), wv);
            const int kk = 16 * part;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                wsf[(kk + 4 * j) * TN + r] = wv[j].x;
                wsf[(kk + 4 * j + 1) * TN + r] = wv[j].y;
                wsf[(kk + 4 * j + 2) * TN + r] = wv[j].z;
                wsf[(kk + 4 * j + 3) * TN + r] = wv[j].w;
            }
        }
        gemm_load_x(x + x_off, n, k, token0, k0, xsf, tid);
        barrier(CLK_LOCAL_MEM_FENCE);
        gemm_tile_mac(ws, xs, acc, tx, ty);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    gemm_tile_store(acc, out + out_off, n, m, token0, row0, tx, ty);
}
