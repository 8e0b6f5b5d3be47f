// Tiled int4 GEMM for prefill and other n > 16: out (n, m) = x (n, k) @ W.T, W in int4.cl's chunk-major
// layout (packed uint4 (k/32, m), half scale and float bias (k/g, m)). The tile is gemm_tile.cl's, one 32-column
// chunk of x and of the dequantized W at a time. Global size (ceil(m / 128) * 16, ceil(n / TM) * 16), local (16, 16).

__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void int4_gemm(
    INT4_WEIGHT_PARAMS(uint4, ushort), __global const float* x, int x_off, __global float* out, int out_off, int n,
    int m, int k, int group_shift) {
    INT4_WEIGHT_AT(uint4);
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
                const float2 f = int4_group(scale, bias, k0 >> group_shift, row, m);
                const float s = f.x, b = f.y;
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
        gemm_load_x(x + x_off, n, k, token0, k0, xsf, tid);
        barrier(CLK_LOCAL_MEM_FENCE);
        gemm_tile_mac(ws, xs, acc, tx, ty);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    gemm_tile_store(acc, out + out_off, n, m, token0, row0, tx, ty);
}
