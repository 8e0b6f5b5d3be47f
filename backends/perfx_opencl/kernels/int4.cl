// int4 matmuls: out (n, m) = x (n, k) @ W.T for an int4 weight W (m, k), and the int4 embedding gather.
//
// Weight layout on the device (re-packed once at load, runtime.py prepare_weight): "chunk-major".
//   packed: uint4 (k/32, m): element [c][r] holds the 32 codes of row r, columns 32c .. 32c+31. Word j of the
//           uint4 holds columns 32c+8j .. +7, nibble i (bits 4i..4i+3) is column 32c+8j+i: the same 16 bytes
//           as perfx_core.weights packs them, so re-packing is a transpose of 16-byte chunks.
//   scale:  float16 bits (k/g, m), read with vload_half so no cl_khr_fp16 is needed;
//   bias:   float (k/g, m).  W[r, c] = code * scale[c/g][r] + bias[c/g][r] (none for Q4_0, a Q4_K's own
//           factors instead of both: int4_group.cl).
// Why chunk-major: consecutive threads take consecutive rows, so a warp's weight loads are one contiguous
// 512-byte run, and all of them read the same activation chunk (a broadcast), which is what makes decode
// (GEMV) run at memory bandwidth. k is a multiple of the group size g (32, 64 or 128), so a chunk never
// spans two groups.
// Activation tensor arguments are (pointer, element offset) pairs: views are offsets, not sub-buffers.

#ifndef NT
#define NT 1  // tokens multiplied per pass over the weights (batched decode: n <= NT)
#endif
#ifndef RW
#define RW 32  // row lanes per work-group (local dimension 0)
#endif
#ifndef KS
#define KS 8  // threads splitting one row's chunks (local dimension 1)
#endif
#ifndef CR
#define CR 1  // output columns per thread (lr, lr + RW, ...): each activation chunk loaded once feeds them all
#endif
#ifdef SILU
#define RR (2 * CR)  // weight rows per thread: the gate rows, then the matching up rows
#else
#define RR CR
#endif
#ifndef UC
#define UC 1  // chunks per thread whose loads are issued together (memory-level parallelism)
#endif

#ifdef X_IMAGE
// Adreno: activations through the texture path (image1d_buffer_t over the same buffer, one float per texel).
#define X_ARG __read_only image1d_buffer_t x
#define LOAD_X4(i)                                                                                         \
    (float4)(read_imagef(x, (i)).x, read_imagef(x, (i) + 1).x, read_imagef(x, (i) + 2).x, read_imagef(x, (i) + 3).x)
#elif defined(X_UNALIGNED)
#define X_ARG __global const float* x
#define LOAD_X4(i) vload4(0, x + (i))
#else
// The host passes x_off % 4 == 0 here (else -DX_UNALIGNED): 16-byte loads, broadcast to the whole warp.
#define X_ARG __global const float* x
#define LOAD_X4(i) (*(__global const float4*)(x + (i)))
#endif

// Nibble -> float without an int-to-float conversion (a quarter-rate instruction on NVIDIA GPUs):
// 0x4B000000 | v is the float 2^23 + v for any v < 2^23, so subtracting 2^23 gives v exactly. Masking a
// nibble in place (no shift) gives v = code * 16^p for nibble p of a 20-bit field; the 16^-p goes into the
// final combination of the chunk's partial sums (exact: powers of two).
#define MAGIC 0x4B000000u
#define MAGIC_F 8388608.0f
#define LO_MASK ((uint4)(0xFu, 0xF0u, 0xF00u, 0xF000u))      // nibbles 0-3 of a word, in place
#define HI_MASK ((uint4)(0xF0u, 0xF00u, 0xF000u, 0xF0000u))  // nibbles 4-7 of the word shifted right by 12
#define LO_UNSCALE ((float4)(1.0f, 0.0625f, 0.00390625f, 0.000244140625f))
#define HI_UNSCALE ((float4)(0.0625f, 0.00390625f, 0.000244140625f, 0.0000152587890625f))

inline float4 lo_codes(uint w) { return as_float4((((uint4)(w)) & LO_MASK) | MAGIC) - MAGIC_F; }
inline float4 hi_codes(uint w) { return as_float4((((uint4)(w >> 12)) & HI_MASK) | MAGIC) - MAGIC_F; }

// The 32 activations of chunk c for token t: xv[2j] are columns 8j..8j+3 (nibbles 0-3 of word j), xv[2j+1]
// columns 8j+4..8j+7. Returns their sum (the bias term: sum(x * (q*s + b)) = s * dot(q, x) + b * sum(x)).
inline float load_chunk_x(X_ARG, int x_off, int t, int k, int c, float4* xv) {
    const int base = x_off + t * k + (c << 5);
    float4 sum = (float4)(0.0f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        xv[i] = LOAD_X4(base + 4 * i);
        sum += xv[i];
    }
    return dot(sum, (float4)(1.0f));
}

// dot(codes of the 16-byte chunk w, the chunk's activations xv).
inline float chunk_dot(uint4 w, const float4* xv) {
    const float4 lo = lo_codes(w.s0) * xv[0] + lo_codes(w.s1) * xv[2] + lo_codes(w.s2) * xv[4] + lo_codes(w.s3) * xv[6];
    const float4 hi = hi_codes(w.s0) * xv[1] + hi_codes(w.s1) * xv[3] + hi_codes(w.s2) * xv[5] + hi_codes(w.s3) * xv[7];
    return dot(lo, LO_UNSCALE) + dot(hi, HI_UNSCALE);
}

// The chunk's 32 weights q * s + b, in the order of load_chunk_x's xv.
inline void dequantize_chunk(uint4 w, float s, float b, float4* wv) {
    const float4 lo_s = s * LO_UNSCALE, hi_s = s * HI_UNSCALE;
    wv[0] = lo_codes(w.s0) * lo_s + b, wv[1] = hi_codes(w.s0) * hi_s + b;
    wv[2] = lo_codes(w.s1) * lo_s + b, wv[3] = hi_codes(w.s1) * hi_s + b;
    wv[4] = lo_codes(w.s2) * lo_s + b, wv[5] = hi_codes(w.s2) * hi_s + b;
    wv[6] = lo_codes(w.s3) * lo_s + b, wv[7] = hi_codes(w.s3) * hi_s + b;
}

#ifdef QX
// Quantized activations (QX, with integer dot products): each 32-column chunk of x becomes 16-bit integers
// q = round(x / d), d = max|x| / 32767, split into a signed high byte and an unsigned low byte (q = 256 h + l),
// so a chunk's dot with the 4-bit codes is 256 * dot(codes, h) + dot(codes, l): 16 byte-wise dot products
// of 4 lanes each (NVIDIA's dp4a) instead of 32 float conversions and multiply-adds. 16 bits keep the logits
// of SmolLM2 within 2e-8 NMSE of float activations; 8 bits alone (llama.cpp's Q8_1) were 7e-4 there.
// Byte order matches the codes: w & 0x0F0F0F0F holds columns 8j+0,2,4,6 of word j, (w >> 4) & .. 8j+1,3,5,7,
// so a chunk's planes are uint4s: [0] high bytes of the even columns (word j in lane j), [1] odd, [2]/[3] low.
#ifdef NV_DP4A
inline int dot_us(uint a, uint b, int c) {  // c + sum of unsigned bytes of a times signed bytes of b
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
inline uint dot_uu(uint a, uint b, uint c) {  // c + sum of unsigned bytes of a times unsigned bytes of b
    uint r;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
#else
// Portable versions (PoCL in CI, other devices when forced): the same integers, slower.
inline int dot_us(uint a, uint b, int c) {
    const uchar4 ua = as_uchar4(a);
    const char4 sb = as_char4(b);
    return c + (int)ua.x * sb.x + (int)ua.y * sb.y + (int)ua.z * sb.z + (int)ua.w * sb.w;
}
inline uint dot_uu(uint a, uint b, uint c) {
    const uchar4 ua = as_uchar4(a), ub = as_uchar4(b);
    return c + (uint)ua.x * ub.x + (uint)ua.y * ub.y + (uint)ua.z * ub.z + (uint)ua.w * ub.w;
}
#endif

inline uint pack_bytes(int a, int b, int c, int d) {
    return (uint)(a & 0xFF) | ((uint)(b & 0xFF) << 8) | ((uint)(c & 0xFF) << 16) | ((uint)(d & 0xFF) << 24);
}

// Chunk c of token t (t < 0: a padding token, all zero) into its four planes at xq; returns (d, sum of x).
inline float2 quantize_chunk(X_ARG, int x_off, int t, int k, int c, __local uint4* xq) {
    float4 xv[8];
    float4 amax = (float4)(0.0f), sum = (float4)(0.0f);
    const int base = x_off + max(t, 0) * k + (c << 5);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        xv[i] = t < 0 ? (float4)(0.0f) : LOAD_X4(base + 4 * i);
        amax = fmax(amax, fabs(xv[i]));
        sum += xv[i];
    }
    const float m = fmax(fmax(amax.x, amax.y), fmax(amax.z, amax.w));
    const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
    int h[32], l[32];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int4 q = clamp(convert_int4_rte(xv[i] * inv), -32767, 32767);
        const int4 lo = q & 0xFF;
        const int4 hi = (q - lo) / 256;  // exact: floor(q / 256) without relying on >> of negatives
        l[4 * i] = lo.x, l[4 * i + 1] = lo.y, l[4 * i + 2] = lo.z, l[4 * i + 3] = lo.w;
        h[4 * i] = hi.x, h[4 * i + 1] = hi.y, h[4 * i + 2] = hi.z, h[4 * i + 3] = hi.w;
    }
    uint4 he, ho, le, lo;
#define QX_WORD(j, lane)                                                                                   \
    he.lane = pack_bytes(h[8 * j], h[8 * j + 2], h[8 * j + 4], h[8 * j + 6]);                              \
    ho.lane = pack_bytes(h[8 * j + 1], h[8 * j + 3], h[8 * j + 5], h[8 * j + 7]);                          \
    le.lane = pack_bytes(l[8 * j], l[8 * j + 2], l[8 * j + 4], l[8 * j + 6]);                              \
    lo.lane = pack_bytes(l[8 * j + 1], l[8 * j + 3], l[8 * j + 5], l[8 * j + 7]);
    QX_WORD(0, x) QX_WORD(1, y) QX_WORD(2, z) QX_WORD(3, w)
#undef QX_WORD
    xq[0] = he, xq[1] = ho, xq[2] = le, xq[3] = lo;
    return (float2)(m / 32767.0f, dot(sum, (float4)(1.0f)));
}

// The integer dot of a chunk's codes (lo = w & 0x0F0F0F0F, hi = (w >> 4) & 0x0F0F0F0F) with its planes.
inline int chunk_idot(uint4 lo, uint4 hi, __local const uint4* xq) {
    const uint4 he = xq[0], ho = xq[1], le = xq[2], lw = xq[3];
    int h = dot_us(lo.x, he.x, 0);
    h = dot_us(hi.x, ho.x, h), h = dot_us(lo.y, he.y, h), h = dot_us(hi.y, ho.y, h);
    h = dot_us(lo.z, he.z, h), h = dot_us(hi.z, ho.z, h), h = dot_us(lo.w, he.w, h), h = dot_us(hi.w, ho.w, h);
    // Adding the low bytes' products to h << 8 in unsigned arithmetic gives the same bits as signed.
    uint v = dot_uu(lo.x, le.x, (uint)h << 8);
    v = dot_uu(hi.x, lw.x, v), v = dot_uu(lo.y, le.y, v), v = dot_uu(hi.y, lw.y, v);
    v = dot_uu(lo.z, le.z, v), v = dot_uu(hi.z, lw.z, v), v = dot_uu(lo.w, le.w, v), v = dot_uu(hi.w, lw.w, v);
    return as_int(v);  // |value| < 2^24: exact as a float
}
#endif

// Weight row of the thread's row slot r. Plain GEMV: rows row0 + r*RW. SILU: slots 0..CR-1 are gate rows
// (row0 + r*RW) and slots CR.. the matching up rows (half + row0 + (r - CR)*RW).
#ifdef SILU
#define SLOT_COL(row0, r) ((row0) + ((r) % CR) * RW)
#define SLOT_ROW(row0, r, half) (SLOT_COL(row0, r) + ((r) >= CR ? (half) : 0))
#else
#define SLOT_COL(row0, r) ((row0) + (r) * RW)
#define SLOT_ROW(row0, r, half) SLOT_COL(row0, r)
#endif

// out (n, cols) = x (n, k) @ W.T for n <= NT; with -DSILU, W = [W_gate; W_up] (2 cols, k) and
// out = silu(x @ W_gate.T) * (x @ W_up.T) (gelu_tanh with -DGELU as well). With -DADD_NORM (linear_add_rmsnorm) the kernel also does
// residual += out; normed = rmsnorm(residual) * norm_w (add_norm_tail.cl). Each work-group covers RW * CR
// output columns, thread (lr, split) takes column slots lr + r*RW and the chunks split, split + KS, ...; the KS
// partial sums meet in local memory. Global size (ceil(cols / cols per work-group) * RW, KS), local (RW, KS).
__kernel __attribute__((reqd_work_group_size(RW, KS, 1))) void int4_gemv(
    INT4_WEIGHT_PARAMS(uint4, ushort), X_ARG, int x_off, __global float* out, int out_off, int n, int cols, int k,
    int group_shift EPILOGUE_ARGS) {
    INT4_WEIGHT_AT(uint4);
#ifdef SILU
    const int m = 2 * cols;
#else
    const int m = cols;
#endif
    __local float partial[KS][RW][RR * NT];
    const int lr = get_local_id(0), split = get_local_id(1);
    const int row0 = get_group_id(0) * RW * CR + lr;
    const int chunks = k >> 5;
#if NT == 1 && defined(XSUM_CHUNKS)
    // The activation's chunk sums (the bias term), computed once per work-group instead of once per thread.
    __local float xsums[XSUM_CHUNKS];
    for (int c = split * RW + lr; c < chunks; c += RW * KS) {
        const int base = x_off + (c << 5);
        float4 sum = (float4)(0.0f);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += LOAD_X4(base + 4 * i);
        xsums[c] = dot(sum, (float4)(1.0f));
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
    float acc[RR][NT];
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

#ifdef QX
    // x quantized into local memory one slice of QX_SLICE chunks (all tokens) at a time, by all threads.
    __local uint4 xq[NT * QX_SLICE * 4];
    __local float2 xd[NT * QX_SLICE];  // (d, sum of x) per token and chunk
    for (int s0 = 0; s0 < chunks; s0 += QX_SLICE) {
        const int end = min(chunks, s0 + QX_SLICE);
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous slice is used up
        for (int e = split * RW + lr; e < NT * QX_SLICE; e += RW * KS) {
            const int t = e / QX_SLICE, c = s0 + e % QX_SLICE;
            if (c < end) xd[e] = quantize_chunk(x, x_off, t < n ? t : -1, k, c, xq + 4 * e);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#else
    {
        const int s0 = 0, end = chunks;
#endif
        for (int c0 = s0 + split; c0 < end; c0 += UC * KS) {
            // Issue every load of the UC chunks x RR rows before using any of them.
            uint4 w[UC][RR];
            float s[UC][RR], b[UC][RR];
#pragma unroll
            for (int u = 0; u < UC; ++u) {
                const int c = c0 + u * KS;
#pragma unroll
                for (int r = 0; r < RR; ++r) {
                    const int row = SLOT_ROW(row0, r, cols);
                    const bool live = c < end && SLOT_COL(row0, r) < cols;
                    const float2 f = live ? int4_group(scale, bias, (c << 5) >> group_shift, row, m) : (float2)(0.0f);
                    w[u][r] = live ? packed[(size_t)c * m + row] : (uint4)(0u);
                    s[u][r] = f.x, b[u][r] = f.y;
                }
            }
#pragma unroll
            for (int u = 0; u < UC; ++u) {
                const int c = c0 + u * KS;
                if (c >= end) break;
#ifdef QX
                // Codes split into even and odd columns once, then per token: 16 dp4a + one scale.
                uint4 lo[RR], hi[RR];
#pragma unroll
                for (int r = 0; r < RR; ++r) lo[r] = w[u][r] & 0x0F0F0F0Fu, hi[r] = (w[u][r] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < n) {
                        const int e = t * QX_SLICE + c - s0;
                        const float2 dq = xd[e];
#pragma unroll
                        for (int r = 0; r < RR; ++r) {
                            const float dot_x = dq.x * (float)chunk_idot(lo[r], hi[r], xq + 4 * e);
                            acc[r][t] += s[u][r] * dot_x + b[u][r] * dq.y;
                        }
                    }
                }
#elif NT == 1
                // One token: s * dot(q, x) + b * sum(x), the sum shared by the RR rows.
                float4 xv[8];
#ifdef XSUM_CHUNKS
                const int base = x_off + (c << 5);
#pragma unroll
                for (int i = 0; i < 8; ++i) xv[i] = LOAD_X4(base + 4 * i);
                const float xsum = xsums[c];
#else
                const float xsum = load_chunk_x(x, x_off, 0, k, c, xv);
#endif
#pragma unroll
                for (int r = 0; r < RR; ++r) acc[r][0] += s[u][r] * chunk_dot(w[u][r], xv) + b[u][r] * xsum;
#else
                // Several tokens: dequantize the RR chunks once (q * s + b), then per token load its activations
                // once for all RR rows: one multiply-add per weight and token.
                float4 wv[RR][8];
#pragma unroll
                for (int r = 0; r < RR; ++r) dequantize_chunk(w[u][r], s[u][r], b[u][r], wv[r]);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < n) {
                        const int base = x_off + t * k + (c << 5);
                        float4 xv[8];
#pragma unroll
                        for (int i = 0; i < 8; ++i) xv[i] = LOAD_X4(base + 4 * i);
#pragma unroll
                        for (int r = 0; r < RR; ++r) {
                            float4 sum = (float4)(0.0f);
#pragma unroll
                            for (int i = 0; i < 8; ++i) sum += wv[r][i] * xv[i];
                            acc[r][t] += dot(sum, (float4)(1.0f));
                        }
                    }
                }
#endif
            }
        }
    }

    // Reduce the KS partials: thread (lr, split) sums outputs e = split, split + KS, ... of its column lane.
#pragma unroll
    for (int r = 0; r < RR; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) partial[split][lr][r * NT + t] = acc[r][t];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = split; e < CR * NT; e += KS) {
        const int r = e / NT, t = e % NT, col = SLOT_COL(row0, r);
        if (t >= n || col >= cols) continue;
        float total = 0.0f;
        for (int i = 0; i < KS; ++i) total += partial[i][lr][r * NT + t];
#ifdef SILU
        float up = 0.0f;
        for (int i = 0; i < KS; ++i) up += partial[i][lr][(r + CR) * NT + t];
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

// Rows ids[i] of an int4 table (vocab, d) in the chunk-major layout, dequantized: global size (d, n).
__kernel void embedding_int4(INT4_WEIGHT_PARAMS(uchar, ushort), __global const int* ids, __global float* out,
                             int out_off, int vocab, int d, int group_shift) {
    INT4_WEIGHT_AT(uchar);
    const int c = get_global_id(0), i = get_global_id(1);
    if (c >= d) return;
    const size_t row = (size_t)ids[i];
    const uchar byte = packed[((size_t)(c >> 5) * vocab + row) * 16 + ((c & 31) >> 1)];
    const float code = (float)((c & 1) ? (byte >> 4) : (byte & 15));
    const float2 f = int4_group(scale, bias, c >> group_shift, row, vocab);
    out[out_off + i * d + c] = code * f.x + f.y;
}
