// GEMV of a byte-decoded weight (int8, int6 or int5: int8_weight.cl): out (n, cols) = x (n, k) @ W.T for n <= NT
// tokens, each weight byte read once per pass, and the embedding gather of such a table. The same scheme as int4.cl's
// int4_gemv: RW row lanes x KS k-splits per work-group, one output column per lane, UC chunks loaded together; with
// -DSILU, W = [W_gate; W_up] (2 cols, k) and out = silu(x @ W_gate.T) * (x @ W_up.T) (gelu_tanh with -DGELU as
// well); with -DADD_NORM the add + RMSNorm tail (add_norm_tail.cl). Global size (ceil(cols / RW) * RW, KS), local
// (RW, KS).

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
    BYTE_WEIGHT_PARAMS, X_ARG, int x_off, __global float* out, int out_off, int n, int cols, int k,
    int group_shift EPILOGUE_ARGS) {
    BYTE_WEIGHT_AT;
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
        float2 s[UC][RR];  // (scale, bias)
#pragma unroll
        for (int u = 0; u < UC; ++u) {
            const int c = c0 + u * KS;
            const bool live = c < chunks && col < cols;
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                const int row = col + r * cols;
                w[u][r] = live ? chunk_words(BYTE_WEIGHT, c, row, m) : (uint4)(0u);
                s[u][r] = live ? chunk_factors(BYTE_WEIGHT, c, row, m, group_shift) : (float2)(0.0f);
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
#ifdef HAS_BIAS
            const float xsum = dot(xv[0] + xv[1] + xv[2] + xv[3], (float4)(1.0f));
#endif
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                const uint4 q = w[u][r];
                const float4 d = word_codes(q.s0) * xv[0] + word_codes(q.s1) * xv[1] + word_codes(q.s2) * xv[2] +
                                 word_codes(q.s3) * xv[3];
                acc[r][0] += s[u][r].x * dot(d, I8_UNSCALE);
#ifdef HAS_BIAS
                acc[r][0] += s[u][r].y * xsum;
#endif
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

// Rows ids[i] of a byte-decoded table (vocab, d) in its chunk-major layout, dequantized: global size (d, n).
__kernel void embedding_int8(BYTE_WEIGHT_PARAMS, __global const int* ids, __global float* out, int out_off, int vocab,
                             int d, int group_shift) {
    BYTE_WEIGHT_AT;
    const int c = get_global_id(0), i = get_global_id(1);
    if (c >= d) return;
    const size_t row = (size_t)ids[i];
    const uint u = chunk_word(BYTE_WEIGHT, c >> 4, row, vocab, (c >> 2) & 3) >> (8 * (c & 3));
    const float2 f = chunk_factors(BYTE_WEIGHT, c >> 4, row, vocab, group_shift);
    out[out_off + i * d + c] = (float)((int)(u & 0xFFu) - CODE_OFFSET) * f.x + f.y;
}

// An int6 or Q5_0 weight in the int8 form, for the matrix units' prompt kernel (int8_mma.cl): codes (k/16, m) and
// one float32 scale per 16 columns (k/16, m), the same values. Global size (m, k/16).
__kernel void to_int8(BYTE_WEIGHT_PARAMS, __global uint4* out_codes, __global float* out_scales, int m) {
    BYTE_WEIGHT_AT;
    const int row = get_global_id(0), c = get_global_id(1);
    const size_t at = (size_t)c * m + row;
    // code + 128 in every byte (at most 159 for int6: no carries), then the sign bit flipped: the signed code
    out_codes[at] = (chunk_words(BYTE_WEIGHT, c, row, m) + (128 - CODE_OFFSET) * 0x01010101u) ^ 0x80808080u;
    out_scales[at] = chunk_factors(BYTE_WEIGHT, c, row, m, 4).x;
}
