// int8 GEMV: out (n, cols) = x (n, k) @ W.T for n <= NT tokens, each weight byte read once per pass (the layout is
// int8_weight.cl's), and the int8 embedding gather. The same scheme as int4.cl's int4_gemv: RW row lanes x KS
// k-splits per work-group, one output column per lane, UC chunks loaded together; with -DSILU, W = [W_gate; W_up]
// (2 cols, k) and out = silu(x @ W_gate.T) * (x @ W_up.T) (gelu_tanh with -DGELU as well); with -DADD_NORM the add + RMSNorm tail
// (add_norm_tail.cl). Global size (ceil(cols / RW) * RW, KS), local (RW, KS).

#ifndef NT
#define NT 1
#endif
#ifndef RW
#define RW 32
#endif
#ifndef KS
#define KS 8
#endif
#ifndef UC
#define UC 1
#endif
#ifdef SILU
#define RR 2  // weight rows per thread: the gate row, then the matching up row
#else
#define RR 1
#endif

// Activations as int4.cl reads them: through the texture path on Adreno (-DX_IMAGE), else 16-byte loads (the host
// passes x_off % 4 == 0; -DX_UNALIGNED otherwise).
#ifdef X_IMAGE
#define X_ARG __read_only image1d_buffer_t x
#define LOAD_X4(i)                                                                                         \
    (float4)(read_imagef(x, (i)).x, read_imagef(x, (i) + 1).x, read_imagef(x, (i) + 2).x, read_imagef(x, (i) + 3).x)
#elif defined(X_UNALIGNED)
#define X_ARG __global const float* x
#define LOAD_X4(i) vload4(0, x + (i))
#else
#define X_ARG __global const float* x
#define LOAD_X4(i) (*(__global const float4*)(x + (i)))
#endif

__kernel __attribute__((reqd_work_group_size(RW, KS, 1))) void int8_gemv(
    __global const uint4* codes, __global const SCALE_T* scale, X_ARG, int x_off, __global float* out, int out_off,
    int n, int cols, int k, int group_shift EPILOGUE_ARGS) {
    const int m = RR * cols;
    __local float partial[KS][RW][RR * NT];
    const int lr = get_local_id(0), split = get_local_id(1);
    const int col = get_group_id(0) * RW + lr;
    const int chunks = k >> 4;
    float acc[RR][NT];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    for (int c0 = split; c0 < chunks; c0 += UC * KS) {
        // Issue every load of the UC chunks x RR rows before using any of them.
        uint4 w[UC][RR];
        float s[UC][RR];
#pragma unroll
        for (int u = 0; u < UC; ++u) {
            const int c = c0 + u * KS;
            const bool live = c < chunks && col < cols;
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                const int row = col + r * cols;
                w[u][r] = live ? codes[(size_t)c * m + row] : (uint4)(0u);
                s[u][r] = live ? LOAD_SCALE((size_t)((c << 4) >> group_shift) * m + row, scale) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < UC; ++u) {
            const int c = c0 + u * KS;
            if (c >= chunks) break;
#if NT == 1
            // One token: s * dot(codes, x) per row, the activations loaded once for the RR rows.
            const int base = x_off + (c << 4);
            float4 xv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) xv[i] = LOAD_X4(base + 4 * i);
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                const uint4 q = w[u][r];
                const float4 d = word_codes(q.s0) * xv[0] + word_codes(q.s1) * xv[1] + word_codes(q.s2) * xv[2] +
                                 word_codes(q.s3) * xv[3];
                acc[r][0] += s[u][r] * dot(d, I8_UNSCALE);
            }
#else
            // Several tokens: dequantize the RR chunks once, then one multiply-add per weight and token.
            float4 wv[RR][4];
#pragma unroll
            for (int r = 0; r < RR; ++r) dequantize_chunk8(w[u][r], s[u][r], wv[r]);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n) {
                    const int base = x_off + t * k + (c << 4);
                    float4 xv[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) xv[i] = LOAD_X4(base + 4 * i);
#pragma unroll
                    for (int r = 0; r < RR; ++r) {
                        const float4 d = wv[r][0] * xv[0] + wv[r][1] * xv[1] + wv[r][2] * xv[2] + wv[r][3] * xv[3];
                        acc[r][t] += dot(d, (float4)(1.0f));
                    }
                }
            }
#endif
        }
    }

    // Reduce the KS partials: thread (lr, split) sums tokens split, split + KS, ... of its column.
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) partial[split][lr][r * NT + t] = acc[r][t];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int t = split; t < n && col < cols; t += KS) {
        float total = 0.0f;
        for (int i = 0; i < KS; ++i) total += partial[i][lr][t];
#ifdef SILU
        float up = 0.0f;
        for (int i = 0; i < KS; ++i) up += partial[i][lr][NT + t];
        total = GATE_ACTIVATION(total) * up;
#endif
        out[out_off + (size_t)t * cols + col] = total;
    }
#ifdef ADD_NORM
    __local int ticket;
    add_norm_tail(out + out_off, POST_W, residual + residual_off, norm_w + norm_w_off, normed + normed_off, n,
                  cols, eps, counter + counter_off, finishers, &partial[0][0][0], &ticket, split * RW + lr, RW * KS);
#endif
}

// Rows ids[i] of an int8 table (vocab, d) in the chunk-major layout, dequantized: global size (d, n).
__kernel void embedding_int8(__global const char* codes, __global const SCALE_T* scale, __global const int* ids,
                             __global float* out, int out_off, int vocab, int d, int group_shift) {
    const int c = get_global_id(0), i = get_global_id(1);
    if (c >= d) return;
    const size_t row = (size_t)ids[i];
    const float code = (float)codes[((size_t)(c >> 4) * vocab + row) * 16 + (c & 15)];
    out[out_off + i * d + c] = code * LOAD_SCALE((size_t)(c >> group_shift) * vocab + row, scale);
}
