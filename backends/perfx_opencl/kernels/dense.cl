// Dense matmuls and embedding for float32 weights, or float16 ones with -DW_HALF (read with vload_half,
// so no cl_khr_fp16 is needed). out (n, m) = x (n, k) @ W.T for W (m, k); any k.

#ifdef W_HALF
#define W_TYPE half
#define LOAD_W(i, w) vload_half((i), (w))
#else
#define W_TYPE float
#define LOAD_W(i, w) ((w)[i])
#endif

#ifdef ADRENO
#define GEMV_LX 64
#define GEMV_LY 2
#else
#define GEMV_LX 32
#define GEMV_LY 4
#endif

// GEMV_LY rows per work-group, GEMV_LX threads striding over k (coalesced), local-memory reduction.
// Global size (GEMV_LX, ceil(m / GEMV_LY) * GEMV_LY, n).
__kernel __attribute__((reqd_work_group_size(GEMV_LX, GEMV_LY, 1))) void dense_gemv(
    __global const W_TYPE* w, __global const float* x, int x_off, __global float* out, int out_off, int m, int k) {
    __local float partial[GEMV_LY][GEMV_LX];
    const int lx = get_local_id(0), ly = get_local_id(1);
    const int row = get_group_id(1) * GEMV_LY + ly;
    const int token = get_global_id(2);
    float acc = 0.0f;
    if (row < m) {
        const size_t w_row = (size_t)row * k;
        const int x_row = x_off + token * k;
        for (int c = lx; c < k; c += GEMV_LX) acc += LOAD_W(w_row + c, w) * x[x_row + c];
    }
    partial[ly][lx] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = GEMV_LX / 2; stride > 0; stride >>= 1) {
        if (lx < stride) partial[ly][lx] += partial[ly][lx + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lx == 0 && row < m) out[out_off + token * m + row] = partial[ly][0];
}

// Tiled GEMM, same scheme as int4_gemm: 16x16 threads, 32x32 output tile, 2x2 per thread.
#define TILE 32
__kernel __attribute__((reqd_work_group_size(16, 16, 1))) void dense_gemm(
    __global const W_TYPE* w, __global const float* x, int x_off, __global float* out, int out_off, int n, int m,
    int k) {
    __local float xs[TILE][TILE + 1];
    __local float ws[TILE][TILE + 1];
    const int tx = get_local_id(0), ty = get_local_id(1), tid = ty * 16 + tx;
    const int row0 = get_group_id(0) * TILE, token0 = get_group_id(1) * TILE;
    float acc00 = 0.0f, acc01 = 0.0f, acc10 = 0.0f, acc11 = 0.0f;
    for (int k0 = 0; k0 < k; k0 += TILE) {
        for (int i = tid; i < TILE * TILE; i += 256) {
            const int r = i / TILE, kk = i % TILE, c = k0 + kk;
            const int token = token0 + r, row = row0 + r;
            xs[r][kk] = (token < n && c < k) ? x[x_off + token * k + c] : 0.0f;
            ws[r][kk] = (row < m && c < k) ? LOAD_W((size_t)row * k + c, w) : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < TILE; ++kk) {
            const float a0 = xs[ty][kk], a1 = xs[ty + 16][kk];
            const float b0 = ws[tx][kk], b1 = ws[tx + 16][kk];
            acc00 += a0 * b0;
            acc01 += a0 * b1;
            acc10 += a1 * b0;
            acc11 += a1 * b1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const int t0 = token0 + ty, t1 = t0 + 16, r0 = row0 + tx, r1 = r0 + 16;
    if (t0 < n && r0 < m) out[out_off + t0 * m + r0] = acc00;
    if (t0 < n && r1 < m) out[out_off + t0 * m + r1] = acc01;
    if (t1 < n && r0 < m) out[out_off + t1 * m + r0] = acc10;
    if (t1 < n && r1 < m) out[out_off + t1 * m + r1] = acc11;
}

// Rows ids[i] of a dense table (vocab, d): global size (d, n).
__kernel void embedding_dense(__global const W_TYPE* table, __global const int* ids, __global float* out,
                              int out_off, int d) {
    const int c = get_global_id(0), i = get_global_id(1);
    if (c >= d) return;
    out[out_off + i * d + c] = LOAD_W((size_t)ids[i] * d + c, table);
}
