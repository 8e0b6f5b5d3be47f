// attention_prefill_mma: causal attention of a long prompt chunk on matrix units (mma.cl), flash-attention
// style: T new rows of ONE sequence (slots[0], rows at consecutive positions from positions[0]) over a
// float16 cache that already holds their k and v (store_kv ran first).
//
// Why: the tiled kernel in attention.cl takes its dot products on the FP32 units through local memory; at 2048
// tokens that was half of a 7B prefill on the H200. Here both products, Q K^T and P V, are mma m16n8k16 with
// float accumulation: q is RoPE'd, scaled and rounded to half once, the probabilities are rounded to half for
// P V (their sum stays float), keys and values are the cache's halves as stored.
//
// A work-group is QW warps over BQ = 16 * QW consecutive query rows of one head, walking the key positions
// in tiles of BK. Each tile of K (row-major) and V (transposed, so a B fragment of P V is one 32-bit load) is
// copied into local memory once for all the warps; each warp multiplies its 16 rows against it and keeps an
// online softmax (running max and sum per row, rescaled per tile) with its output rows in registers. Scores
// are in log2 units (q carries log2(e)), so the exponentials are exp2. Rows past T compute a copy of the last
// row and are not stored, so every lane runs the same loop (the emulation's barriers need that).
//
// Built with -DHD=<head_dim> (a multiple of 16, at most 128: the output rows live in registers), -DQW, -DBK.
// Global size (32 * QW * n_heads, ceil(T / BQ)), local (32 * QW, 1). Blocks run last first: under the causal
// mask the last rows have the most keys, so the longest work-groups start first.

#ifndef BK
#error "attention_mma needs -DBK (key positions per tile, a multiple of 16)"
#endif
#define BQ (16 * QW)
#define K_STRIDE (HD / 2 + 4)  // words per key in ks: 4 more than a row, so lanes g and g + 1 use different banks
#define V_STRIDE (BK / 2 + 4)  // words per head dim in vt (V transposed), padded the same way
#define LOG2E 1.4426950408889634f

// Two adjacent dims (d, d + 1; d even) of a query row, RoPE'd at position pos and scaled, as a half pair.
inline uint rope_q_pair(__global const float* q, __global const float* cos_p, __global const float* sin_p, int d,
                        float scale) {
    const int i = d < HD / 2 ? d : d - HD / 2;  // d and d + 1 sit on the same side of the pairing
    const float2 x1 = vload2(0, q + i), x2 = vload2(0, q + i + HD / 2);
    const float2 c = vload2(0, cos_p + i), s = vload2(0, sin_p + i);
    const float2 r = d < HD / 2 ? x1 * c - x2 * s : x2 * c + x1 * s;
    return half2_of(r.x * scale, r.y * scale);
}

__kernel __attribute__((reqd_work_group_size(32 * QW, 1, 1))) void attention_prefill_mma(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
    __global const ushort* k_cache, __global const ushort* v_cache, int layer, int n_slots, int n_kv, int max_seq,
    int rows, int n_heads, int qkv_dim, __global float* out, int out_off, float score_scale) {
    __local uint4 ks_vectors[BK * K_STRIDE / 4];  // uint4: the tile's 16-byte stores need that alignment
    __local uint vt[HD * V_STRIDE];
    __local uint* ks = (__local uint*)ks_vectors;
    const int lid = get_local_id(0), lane = lid & 31, warp = lid >> 5, g = lane >> 2, t = lane & 3;
#ifndef NV_MMA
    __local float emulation_scratch[QW][MMA_SCRATCH];
    __local float* mma_scratch = emulation_scratch[warp];
#endif
    const int h = get_group_id(0), block = get_num_groups(1) - 1 - get_group_id(1);
    const int kv_head = h / (n_heads / n_kv), start = positions[0], half_d = HD / 2;
    const int last = start + min(rows, (block + 1) * BQ) - 1;  // the block's last query position
    const size_t base = cache_index(layer, slots[0], kv_head, 0, n_slots, n_kv, max_seq, HD);

    // This lane's query rows: g and g + 8 of the warp's 16 (clamped into range, see above).
    const int row_lo = block * BQ + 16 * warp + g, row_hi = row_lo + 8;
    const int pos_lo = start + min(row_lo, rows - 1), pos_hi = start + min(row_hi, rows - 1);
    uint qa[HD / 16][4];  // A fragments of q, one per 16 dims
    {
        const float scale = score_scale * LOG2E;
        __global const float* q_lo = qkv + qkv_off + (pos_lo - start) * qkv_dim + h * HD;
        __global const float* q_hi = qkv + qkv_off + (pos_hi - start) * qkv_dim + h * HD;
        __global const float *cos_lo = cos_t + cos_off + pos_lo * half_d, *sin_lo = sin_t + sin_off + pos_lo * half_d;
        __global const float *cos_hi = cos_t + cos_off + pos_hi * half_d, *sin_hi = sin_t + sin_off + pos_hi * half_d;
#pragma unroll
        for (int s = 0; s < HD / 16; ++s) {
            const int d = 16 * s + 2 * t;
            qa[s][0] = rope_q_pair(q_lo, cos_lo, sin_lo, d, scale);
            qa[s][1] = rope_q_pair(q_hi, cos_hi, sin_hi, d, scale);
            qa[s][2] = rope_q_pair(q_lo, cos_lo, sin_lo, d + 8, scale);
            qa[s][3] = rope_q_pair(q_hi, cos_hi, sin_hi, d + 8, scale);
        }
    }

    float o[HD / 8][4];  // C fragments of the output, one per 8 dims
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;  // running max and (lane's part of) sum

    for (int first = WINDOW_START(start + block * BQ) / BK * BK; first <= last; first += BK) {
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile is no longer read
        // K: consecutive work-items along a key's 16-byte pieces (coalesced). Positions past the block's last
        // query are zero: masked below, and never read from beyond what was written.
        for (int e = lid; e < BK * HD / 8; e += 32 * QW) {
            const int j = e / (HD / 8), c = e % (HD / 8), pos = first + j;
            const uint4 kv = pos <= last ? *(__global const uint4*)(k_cache + base + (size_t)pos * HD + 8 * c) : (uint4)(0);
            *(__local uint4*)(ks + j * K_STRIDE + 4 * c) = kv;
        }
        // V transposed: consecutive work-items take consecutive positions, so their 16-bit stores share no bank.
        for (int e = lid; e < BK * HD / 8; e += 32 * QW) {
            const int j = e % BK, c = e / BK, pos = first + j;
            const uint4 vv = pos <= last ? *(__global const uint4*)(v_cache + base + (size_t)pos * HD + 8 * c) : (uint4)(0);
            __local ushort* col = (__local ushort*)vt + 8 * c * (2 * V_STRIDE) + j;
            const uint w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                col[(2 * u) * (2 * V_STRIDE)] = (ushort)w[u];
                col[(2 * u + 1) * (2 * V_STRIDE)] = (ushort)(w[u] >> 16);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        float sc[BK / 8][4];  // scores: C fragments, one per 8 key positions
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int s = 0; s < HD / 16; ++s)
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                const __local uint* key = ks + (8 * n + g) * K_STRIDE + 8 * s + t;
                MMA(sc[n], qa[s][0], qa[s][1], qa[s][2], qa[s][3], key[0], key[4]);
            }

        // Causal (and window) mask, then the online softmax: each row's max over the quad of lanes that share it.
        float max_lo = -INFINITY, max_hi = -INFINITY;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = first + 8 * n + 2 * t + e;
                sc[n][e] = key > pos_lo || key < WINDOW_START(pos_lo) ? -INFINITY : CAPPED(sc[n][e], LOG2E);
                sc[n][2 + e] = key > pos_hi || key < WINDOW_START(pos_hi) ? -INFINITY : CAPPED(sc[n][2 + e], LOG2E);
                max_lo = fmax(max_lo, sc[n][e]), max_hi = fmax(max_hi, sc[n][2 + e]);
            }
        max_lo = fmax(max_lo, LANE_XOR(max_lo, 1));
        max_lo = fmax(max_lo, LANE_XOR(max_lo, 2));
        max_hi = fmax(max_hi, LANE_XOR(max_hi, 1));
        max_hi = fmax(max_hi, LANE_XOR(max_hi, 2));
        // Without a window the first tile holds position 0, which every row sees, and from then on the maxima are
        // finite; with one, a row may see nothing of its block's first tiles: its max stays -inf, and so must
        // the exponentials stay 0 and the sums untouched (-inf - -inf would be NaN).
        const float new_lo = fmax(m_lo, max_lo), new_hi = fmax(m_hi, max_hi);
#ifdef WINDOW
        const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo, base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
#else
        const float base_lo = new_lo, base_hi = new_hi;
#endif
        const float keep_lo = exp2(m_lo - base_lo), keep_hi = exp2(m_hi - base_hi);
        m_lo = new_lo, m_hi = new_hi, l_lo *= keep_lo, l_hi *= keep_hi;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sc[n][e] = exp2(sc[n][e] - base_lo), l_lo += sc[n][e];
                sc[n][2 + e] = exp2(sc[n][2 + e] - base_hi), l_hi += sc[n][2 + e];
            }
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) o[n][0] *= keep_lo, o[n][1] *= keep_lo, o[n][2] *= keep_hi, o[n][3] *= keep_hi;

        // P V: two adjacent score fragments are one A fragment (16 keys).
#pragma unroll
        for (int s = 0; s < BK / 16; ++s) {
            const uint p0 = half2_of(sc[2 * s][0], sc[2 * s][1]), p1 = half2_of(sc[2 * s][2], sc[2 * s][3]);
            const uint p2 = half2_of(sc[2 * s + 1][0], sc[2 * s + 1][1]);
            const uint p3 = half2_of(sc[2 * s + 1][2], sc[2 * s + 1][3]);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const __local uint* dim = vt + (8 * n + g) * V_STRIDE + 8 * s + t;
                MMA(o[n], p0, p1, p2, p3, dim[0], dim[4]);
            }
        }
    }

    l_lo += LANE_XOR(l_lo, 1);
    l_lo += LANE_XOR(l_lo, 2);
    l_hi += LANE_XOR(l_hi, 1);
    l_hi += LANE_XOR(l_hi, 2);
    const int row_stride = n_heads * HD;
    __global float* out_lo = out + out_off + row_lo * row_stride + h * HD + 2 * t;
    __global float* out_hi = out_lo + 8 * row_stride;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        if (row_lo < rows) vstore2((float2)(o[n][0], o[n][1]) / l_lo, 0, out_lo + 8 * n);
        if (row_hi < rows) vstore2((float2)(o[n][2], o[n][3]) / l_hi, 0, out_hi + 8 * n);
    }
}
