// Attention over the KV cache, layout (layer, slot, kv_head, position, head_dim); float32, or float16 with
// -DCACHE_HALF (vload_half / vstore_half: no cl_khr_fp16 needed). The general path is two launches: store_kv
// writes RoPE'd k and raw v of every new row, then attention reads the cache as stored. Where head_dim is a
// multiple of 4, decode (attention_decode_fused, where the runtime allows fused tails) and prefill chunks of up
// to 32 rows (attention_prefill with stores_rows) each take one launch that also stores the new rows; with a
// float16 cache those use the new rows' own k and v unrounded, and later steps the stored halves.
// A "row" is one new token: decode has one per sequence, prefill T of one sequence; rows[r] = (slot, pos).

#ifdef CACHE_HALF
#define CACHE_T half
#define LOAD_C(i, p) vload_half((i), (p))
#define LOAD_C4(i, p) vload_half4(0, (p) + (i))
#define LOAD_C4A(i, p) vloada_half4((i) >> 2, (p))  // i a multiple of 4: one aligned 8-byte load
#define STORE_C(v, i, p) vstore_half((v), (i), (p))
#define STORE_C4(v, i, p) vstore_half4((v), 0, (p) + (i))
#else
#define CACHE_T float
#define LOAD_C(i, p) ((p)[i])
#define LOAD_C4(i, p) vload4(0, (p) + (i))
#define LOAD_C4A(i, p) (*(__global const float4*)((p) + (i)))  // i a multiple of 4: one aligned 16-byte load
#define STORE_C(v, i, p) ((p)[i] = (v))
#define STORE_C4(v, i, p) vstore4((v), 0, (p) + (i))
#endif

#define ATT_WG 128
#define MAX_HEAD_DIM 256
#ifndef PART
#define PART 128  // key positions per work-group (one per thread while scoring)
#endif

// Global size (hd / 2, n_kv, rows): one rotate-half pair of k (and the two v values) per work-item.
__kernel void store_kv(__global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
                       __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
                       __global CACHE_T* k_cache, __global CACHE_T* v_cache, int layer, int n_slots, int n_kv,
                       int max_seq, int hd, int q_dim, int qkv_dim) {
    const int i = get_global_id(0), j = get_global_id(1), r = get_global_id(2);
    const int half_d = hd / 2;
    if (i >= half_d) return;
    const int pos = positions[r];
    const int k_at = qkv_off + r * qkv_dim + q_dim + j * hd;
    const int v_at = k_at + n_kv * hd;
    const float c = cos_t[cos_off + pos * half_d + i], s = sin_t[sin_off + pos * half_d + i];
    const float x1 = qkv[k_at + i], x2 = qkv[k_at + i + half_d];
    const size_t at = cache_index(layer, slots[r], j, pos, n_slots, n_kv, max_seq, hd);
    STORE_C(x1 * c - x2 * s, at + i, k_cache);
    STORE_C(x2 * c + x1 * s, at + i + half_d, k_cache);
    STORE_C(qkv[v_at + i], at + i, v_cache);
    STORE_C(qkv[v_at + i + half_d], at + i + half_d, v_cache);
}

inline float group_reduce(__local float* scratch, float value, int take_max) {
    const int lid = get_local_id(0);
    scratch[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = ATT_WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride)
            scratch[lid] = take_max ? fmax(scratch[lid], scratch[lid + stride]) : scratch[lid] + scratch[lid + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float result = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return result;
}

// Split attention (flash-decoding): the positions 0..pos of a row are cut into partitions of PART positions and
// each work-group scores one (query head, row, partition), so a decode step with few heads and sequences still
// fills the device. A partition writes its softmax statistics (max, sum) and its unnormalised P.V into `partial`;
// attention_merge combines them. With a single partition the result is written to `out` directly.
// Global size (ATT_WG * n_heads, rows, parts); partial holds (rows, n_heads, parts, hd + 2) floats.
// Grouped-query: head h reads kv head h / (n_heads / n_kv).
__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1))) void attention(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
    __global const CACHE_T* k_cache, __global const CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq,
    int hd, int n_heads, int qkv_dim, __global float* out, int out_off, float score_scale, __global float* partial,
    int partial_off) {
    __local float q[MAX_HEAD_DIM];
    __local float p[PART];
    __local float scratch[ATT_WG];
    const int lid = get_local_id(0), h = get_group_id(0), r = get_group_id(1), part = get_group_id(2);
    const int parts = get_num_groups(2);
    const int pos = positions[r], half_d = hd / 2;
    const int first = WINDOW_START(pos) + part * PART, count = min(PART, pos + 1 - first);  // <= 0: nothing to score
    const int kv_head = h / (n_heads / n_kv);
    const int q_at = qkv_off + r * qkv_dim + h * hd;
    for (int i = lid; i < half_d; i += ATT_WG) {
        const float c = cos_t[cos_off + pos * half_d + i], s = sin_t[sin_off + pos * half_d + i];
        const float x1 = qkv[q_at + i], x2 = qkv[q_at + i + half_d];
        q[i] = x1 * c - x2 * s;
        q[i + half_d] = x2 * c + x1 * s;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const size_t base = cache_index(layer, slots[r], kv_head, first, n_slots, n_kv, max_seq, hd);
    float local_max = -INFINITY;
    for (int s = lid; s < count; s += ATT_WG) {
        const size_t key = base + (size_t)s * hd;
        float score = 0.0f;
        int d = 0;
        for (; d + 4 <= hd; d += 4) score += dot(vload4(0, q + d), LOAD_C4(key + d, k_cache));
        for (; d < hd; ++d) score += q[d] * LOAD_C(key + d, k_cache);
        score = CAPPED(score * score_scale, 1.0f);
        p[s] = score;
        local_max = fmax(local_max, score);
    }
    const float max_score = group_reduce(scratch, local_max, 1);
    float local_sum = 0.0f;
    for (int s = lid; s < count; s += ATT_WG) {
        const float e = exp(p[s] - max_score);
        p[s] = e;
        local_sum += e;
    }
    const float sum = group_reduce(scratch, local_sum, 0);  // its barriers also publish p[]
    const size_t stats = partial_off + (((size_t)r * n_heads + h) * parts + part) * (hd + 2);
    for (int d = lid; d < hd; d += ATT_WG) {
        float a = 0.0f;
        for (int s = 0; s < count; ++s) a += p[s] * LOAD_C(base + (size_t)s * hd + d, v_cache);
        if (parts == 1)
            out[out_off + r * n_heads * hd + h * hd + d] = a / sum;
        else
            partial[stats + 2 + d] = a;
    }
    if (parts > 1 && lid == 0) {
        partial[stats] = count > 0 ? max_score : -INFINITY;
        partial[stats + 1] = count > 0 ? sum : 0.0f;
    }
}

// Combines the partitions of attention: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
// Global size (hd, n_heads, rows).
__kernel void attention_merge(__global const float* partial, int partial_off, int parts, int hd, int n_heads,
                              __global float* out, int out_off) {
    const int d = get_global_id(0), h = get_global_id(1), r = get_global_id(2);
    if (d >= hd) return;
    const size_t base = partial_off + ((size_t)r * n_heads + h) * parts * (hd + 2);
    float m = -INFINITY;
    for (int i = 0; i < parts; ++i) m = fmax(m, partial[base + i * (hd + 2)]);
    float num = 0.0f, den = 0.0f;
    for (int i = 0; i < parts; ++i) {
        const size_t at = base + i * (hd + 2);
        if (partial[at + 1] > 0.0f) {
            const float w = exp(partial[at] - m);
            num += w * partial[at + 2 + d];
            den += w * partial[at + 1];
        }
    }
    out[out_off + r * n_heads * hd + h * hd + d] = num / den;
}

// -- prefill, tiled ---------------------------------------------------------------------------------------
// attention_prefill: causal attention of T new rows of ONE sequence (slots[0], rows at consecutive positions
// from positions[0]) over the cache and themselves; with stores_rows it also stores their k and v (else
// store_kv did, and every key comes from the cache: cheaper for long prompts, see ops.py). A
// work-group takes QB consecutive query rows of one head and walks the key positions in tiles of KB: each tile
// of K and V is read once into local memory and used by all QB rows (the per-row kernel above reads every key
// once per row: at 512 tokens that was 78 of the prefill's 124 ms on the H200). Keys before the rows come from
// the cache, the rows' own from qkv (k RoPE'd here), so no work-group reads what another writes; the
// work-groups of the first query head of each kv head write their own rows' k and v to the cache while loading
// them into a tile. (A store_kv launch took ~0.18 ms of a 7B mixed step on the H200; a loop storing the rows
// before the tiles cost the kernel as much.) Online softmax per row (running max and sum, rescaled per tile),
// so one pass suffices.
// Built with -DHD=<head_dim> (a multiple of 4), -DQB, -DKB; the slot and positions come from the uploaded
// index buffers, so a recorded launch replays for any prompt of the same length.
// Global size (ATT_WG * n_heads, ceil(T / QB)), local (ATT_WG, 1).
#if defined(HD) && defined(QB) && defined(KB)
#define DPT ((HD + ATT_WG - 1) / ATT_WG)  // output dims per thread: d = lid + u * ATT_WG

// Dims i..i+3 of a new row's k (x: its k in qkv) RoPE'd at the position of cos/sin, as store_kv does: dim d
// pairs with d + HD/2 (first half: x1 c - x2 s) or d - HD/2 (second half: x2 c + x1 s).
inline float4 rope_k4(__global const float* x, __global const float* cos_p, __global const float* sin_p, int i) {
#if HD % 8 == 0  // half a head is whole float4s: one side of the pairing for all four dims
    const int p = i < HD / 2 ? i : i - HD / 2;
    const float4 x1 = vload4(0, x + p), x2 = vload4(0, x + p + HD / 2);
    const float4 c = vload4(0, cos_p + p), s = vload4(0, sin_p + p);
    return i < HD / 2 ? x1 * c - x2 * s : x2 * c + x1 * s;
#else
    float k[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int d = i + u, p = d < HD / 2 ? d : d - HD / 2;
        const float x1 = x[p], x2 = x[p + HD / 2];
        k[u] = d < HD / 2 ? x1 * cos_p[p] - x2 * sin_p[p] : x2 * cos_p[p] + x1 * sin_p[p];
    }
    return (float4)(k[0], k[1], k[2], k[3]);
#endif
}

// The local arrays of a prefill work-group, declared by each kernel that runs prefill_block (separate arrays,
// not one struct: the compiler then knows they do not overlap).
#define PREFILL_LOCALS                                                       \
    __local float qs[QB][HD + 1]; /* +1: rows in different banks while scoring */ \
    __local float ks[KB][HD + 1];                                            \
    __local float vs[KB][HD];                                                \
    __local float ps[QB][KB + 1];                                            \
    __local float row_scale[QB]; /* e^(old max - new max) of each row for this tile */
#define PREFILL_LOCAL_ARGS qs, ks, vs, ps, row_scale

// Query rows block * QB.. of head h (the work-group (h, block) of attention_prefill). Always inlined: called
// with separate local arrays, the compiler then knows they do not overlap.
inline __attribute__((always_inline)) void prefill_block(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off, __global CACHE_T* k_cache,
    __global CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq, int rows, int n_heads, int qkv_dim,
    __global float* out, int out_off, float score_scale, int stores_rows, const int h, const int block,
    __local float (*qs)[HD + 1], __local float (*ks)[HD + 1], __local float (*vs)[HD], __local float (*ps)[KB + 1],
    __local float* row_scale) {
    const int lid = get_local_id(0), r0 = block * QB;
    // The first position read from qkv rather than the cache: none when store_kv stored the rows beforehand.
    const int kv_head = h / (n_heads / n_kv), half_d = HD / 2, start = stores_rows ? positions[0] : INT_MAX;
    const int n_rows = min(QB, rows - r0), last = positions[r0 + n_rows - 1];  // the block's last query position
    const int k_col = qkv_off + n_heads * HD + kv_head * HD, v_col = k_col + n_kv * HD;  // in a row of qkv
    const size_t base = cache_index(layer, slots[0], kv_head, 0, n_slots, n_kv, max_seq, HD);
    const bool writer = h % (n_heads / n_kv) == 0;  // stores this block's rows for its kv head
    // q of the block's rows, RoPE'd and pre-scaled; rows past the end are zero.
    for (int e = lid; e < QB * half_d; e += ATT_WG) {
        const int r = e / half_d, i = e % half_d;
        float a = 0.0f, b = 0.0f;
        if (r < n_rows) {
            const int pos = positions[r0 + r], q_at = qkv_off + (r0 + r) * qkv_dim + h * HD;
            const float c = cos_t[cos_off + pos * half_d + i], s = sin_t[sin_off + pos * half_d + i];
            const float x1 = qkv[q_at + i], x2 = qkv[q_at + i + half_d];
            a = (x1 * c - x2 * s) * score_scale, b = (x2 * c + x1 * s) * score_scale;
        }
        qs[r][i] = a, qs[r][i + half_d] = b;
    }
    float m = -INFINITY, l = 0.0f;  // running max and sum of row `lid` (threads lid < QB)
    float acc[QB][DPT];
#pragma unroll
    for (int r = 0; r < QB; ++r)
#pragma unroll
        for (int u = 0; u < DPT; ++u) acc[r][u] = 0.0f;
    for (int first = WINDOW_START(positions[r0]) / KB * KB; first <= last; first += KB) {
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous tile's ks, vs and ps are no longer read
        for (int e = lid; e < KB * HD / 4; e += ATT_WG) {
            const int j = e / (HD / 4), i = 4 * (e % (HD / 4)), pos = first + j;
            float4 kv = (float4)(0.0f), vv = (float4)(0.0f);  // positions past the block's last: not scored
            if (pos < start) {
                const size_t at = base + (size_t)pos * HD + i;
                kv = LOAD_C4A(at, k_cache), vv = LOAD_C4A(at, v_cache);
            } else if (pos <= last) {  // one of the new rows
                const int row = (pos - start) * qkv_dim;
                vv = vload4(0, qkv + row + v_col + i);
                kv = rope_k4(qkv + row + k_col, cos_t + cos_off + pos * half_d, sin_t + sin_off + pos * half_d, i);
                if (writer && pos >= positions[r0]) {  // this block's own row: into the cache
                    STORE_C4(kv, base + (size_t)pos * HD + i, k_cache);
                    STORE_C4(vv, base + (size_t)pos * HD + i, v_cache);
                }
            }
            ks[j][i] = kv.x, ks[j][i + 1] = kv.y, ks[j][i + 2] = kv.z, ks[j][i + 3] = kv.w;
            vstore4(vv, 0, &vs[j][i]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < QB * KB; e += ATT_WG) {
            const int r = e / KB, j = e % KB;
            float score = -INFINITY;  // causal: a row sees positions up to its own (and within its window)
            if (r < n_rows && first + j <= positions[r0 + r] && first + j >= WINDOW_START(positions[r0 + r])) {
                score = 0.0f;
#pragma unroll 8
                for (int i = 0; i < HD; ++i) score = fma(qs[r][i], ks[j][i], score);
                score = CAPPED(score, 1.0f);
            }
            ps[r][j] = score;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < QB) {  // online softmax of row lid over this tile
            float tile_max = -INFINITY;
            for (int j = 0; j < KB; ++j) tile_max = fmax(tile_max, ps[lid][j]);
            const float new_m = fmax(m, tile_max);
            const float scale = new_m == -INFINITY ? 1.0f : exp(m - new_m);
            float sum = 0.0f;
            for (int j = 0; j < KB; ++j) {
                const float e = new_m == -INFINITY ? 0.0f : exp(ps[lid][j] - new_m);
                ps[lid][j] = e;
                sum += e;
            }
            m = new_m, l = l * scale + sum;
            row_scale[lid] = scale;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int u = 0; u < DPT; ++u) {
            const int d = lid + u * ATT_WG;
            if (d < HD)
#pragma unroll
                for (int r = 0; r < QB; ++r) {
                    float a = acc[r][u] * row_scale[r];
                    for (int j = 0; j < KB; ++j) a = fma(ps[r][j], vs[j][d], a);
                    acc[r][u] = a;
                }
        }
    }
    // Each row's sum lives in thread `row`: publish the sums, then every thread divides its dims.
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < QB) row_scale[lid] = l;
    barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
    for (int u = 0; u < DPT; ++u) {
        const int d = lid + u * ATT_WG;
        if (d < HD)
            for (int r = 0; r < n_rows; ++r)
                out[out_off + (r0 + r) * n_heads * HD + h * HD + d] = acc[r][u] / row_scale[r];
    }
}

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1))) void attention_prefill(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
    __global CACHE_T* k_cache, __global CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq, int rows,
    int n_heads, int qkv_dim, __global float* out, int out_off, float score_scale, int stores_rows) {
    PREFILL_LOCALS
    prefill_block(qkv, qkv_off, slots, positions, cos_t, cos_off, sin_t, sin_off, k_cache, v_cache, layer, n_slots,
                  n_kv, max_seq, rows, n_heads, qkv_dim, out, out_off, score_scale, stores_rows, get_group_id(0),
                  get_group_id(1), PREFILL_LOCAL_ARGS);
}
#endif

// -- decode in one launch: the context split over work-groups, one per kv head ------------------------------
// attention_decode_fused: one new token per row (each row its own slot). Does what store_kv + attention +
// attention_merge do, in one kernel. Built with -DHD=<head_dim> (a multiple of 4, so the loops over a head unroll),
// -DGROUP=<query heads per kv head> and -DMAX_SPLIT=<positions a work-group takes at most>.
// - Work-group (kv head j, row r, split) takes a run of the row's positions for all GROUP query heads of kv head
//   j: each key and value is read once per group of query heads (grouped-query attention), not once per head.
// - The host picks the number of splits by depth and device (ops.py _decode_splits); a row's positions 0..pos
//   are cut into that many runs of L = ceil((pos + 1) / splits) rounded up to 16 (the last ones may be empty).
// - Reads are coalesced 16-byte vectors (8 halves or 4 floats): while scoring, KL adjacent lanes take a key's
//   adjacent vectors; in P.V, CHUNKS adjacent lanes take a row of V. So a warp's load covers whole 32-byte
//   sectors of a few rows instead of a piece of 16 rows.
// - Scores of the whole run stay in local memory (two passes: max, then exp and sum), then P.V.
// - The work-group whose run ends at the new token writes its k (RoPE'd) and v to the cache first and reads them
//   back after a barrier, so this step sees the stored (rounded) values as later steps will; no other
//   work-group reads that position.
// - With several splits, the last work-group of a (row, kv head) to finish merges the partials (an atomic
//   counter per (row, kv head), set back to zero by that work-group), instead of a separate merge launch.
// Global size (ATT_WG * n_kv, rows, splits), local (ATT_WG, 1, 1); counters: rows * n_kv ints, zero.
#ifdef HD
#ifndef GROUP
#define GROUP 1
#endif
#ifndef MAX_SPLIT
#define MAX_SPLIT 2048
#endif
#if defined(CACHE_HALF) && HD % 8 == 0
#define CV 8  // cache elements per vector load: 16 bytes
typedef float8 cvec;
#define LOAD_CV(i, p) vloada_half8((i) >> 3, (p))  // i a multiple of 8
#define STORE_CV(v, p) vstore8((v), 0, (p))
inline float cvec_dot(float8 a, float8 b) { return dot(a.lo, b.lo) + dot(a.hi, b.hi); }
#else
#define CV 4
typedef float4 cvec;
#define LOAD_CV(i, p) LOAD_C4A(i, p)
#define STORE_CV(v, p) vstore4((v), 0, (p))
inline float cvec_dot(float4 a, float4 b) { return dot(a, b); }
#endif
#define CHUNKS (HD / CV)  // vectors per key or value row
#if CHUNKS % 8 == 0
#define KL 8  // lanes per key while scoring
#elif CHUNKS % 4 == 0
#define KL 4
#elif CHUNKS % 2 == 0
#define KL 2
#else
#define KL 1
#endif
#define KPP (ATT_WG / KL)  // keys per pass of the work-group
// Passes per tile: a tile's GROUP x TILE scores are summed by one pass of the work-group where they fit.
#define PASSES (ATT_WG / GROUP / KPP > 0 ? ATT_WG / GROUP / KPP : 1)
#define TILE (PASSES * KPP)
#define STRIPES (ATT_WG / CHUNKS)  // positions in flight in P.V
// The local arrays of a decode work-group (separate arrays, as PREFILL_LOCALS).
#define DECODE_LOCALS                                                             \
    __local cvec q_heads[GROUP * CHUNKS];           /* the heads' q, RoPE'd and scaled */ \
    __local float tile_dots[GROUP * PASSES * ATT_WG]; /* a tile's partial dot products */   \
    __local float pw[GROUP * MAX_SPLIT];       /* the run's scores, then weights */   \
    __local float red[GROUP * ATT_WG];         /* reductions */                        \
    __local cvec pv[ATT_WG];                   /* one head's P.V partial sums */       \
    __local int merging;
#define DECODE_LOCAL_ARGS q_heads, tile_dots, pw, red, pv, &merging

// The GROUP values v[] of every work-item reduced over the work-group (max or sum), returned in v[] to all.
inline __attribute__((always_inline)) void reduce_heads(__local float* red, float* v, int take_max) {
    const int lid = get_local_id(0);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) red[g * ATT_WG + lid] = v[g];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = ATT_WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride)
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float a = red[g * ATT_WG + lid], b = red[g * ATT_WG + lid + stride];
                red[g * ATT_WG + lid] = take_max ? fmax(a, b) : a + b;
            }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) v[g] = red[g * ATT_WG];
    barrier(CLK_LOCAL_MEM_FENCE);
}

// The last work-group's merge of the splits of one (row, kv head): out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i
// per head, from `parts_at` (GROUP heads x parts x (m, l, acc[HD])). The reads do not wait for each other: the
// maxima and the weights are spread over the work-items, and the weighted sums load several splits at once.
// Only this work-group is left running at the end of a batch-1 step, so its latency is the kernel's tail.
// `weights` holds GROUP x MAX_SPLIT floats.
#define MERGE_E ((GROUP * HD + ATT_WG - 1) / ATT_WG)  // output elements per work-item
inline __attribute__((always_inline)) void merge_splits(__global const float* partial_at, int parts,
                                                        __global float* out_at, __local float* weights,
                                                        __local float* red) {
    const int lid = get_local_id(0);
    // Volatile reads go past the (non-coherent) L1 cache to where the other work-groups' writes landed.
    volatile __global const float* parts_at = partial_at;
    float top[GROUP], den[GROUP], num[MERGE_E];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) top[g] = -INFINITY, den[g] = 0.0f;
#pragma unroll
    for (int k = 0; k < MERGE_E; ++k) num[k] = 0.0f;
    for (int i = lid; i < parts; i += ATT_WG)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) top[g] = fmax(top[g], parts_at[((size_t)g * parts + i) * (HD + 2)]);
    reduce_heads(red, top, 1);  // red[g * ATT_WG] keeps head g's maximum until the next reduction
    for (int i0 = 0; i0 < parts; i0 += MAX_SPLIT) {  // splits i0.. of every head, as many as `weights` holds
        const int n = min(MAX_SPLIT, parts - i0);
        barrier(CLK_LOCAL_MEM_FENCE);  // the previous slice's weights are no longer read
        for (int e = lid; e < GROUP * n; e += ATT_WG) {
            const int g = e / n, i = e % n;
            const size_t at = ((size_t)g * parts + i0 + i) * (HD + 2);
            const float l = parts_at[at + 1], w = l > 0.0f ? exp(parts_at[at] - red[g * ATT_WG]) : 0.0f;
            weights[g * MAX_SPLIT + i] = w;
#pragma unroll
            for (int h = 0; h < GROUP; ++h) den[h] += h == g ? w * l : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int k = 0; k < MERGE_E; ++k) {
            const int e = lid + k * ATT_WG, g = e / HD, d = e % HD;
            if (e < GROUP * HD) {
                float a = num[k];
#pragma unroll 8
                for (int i = 0; i < n; ++i)
                    a += weights[g * MAX_SPLIT + i] * parts_at[((size_t)g * parts + i0 + i) * (HD + 2) + 2 + d];
                num[k] = a;
            }
        }
    }
    reduce_heads(red, den, 0);
#pragma unroll
    for (int k = 0; k < MERGE_E; ++k) {
        const int e = lid + k * ATT_WG;
        if (e < GROUP * HD) out_at[e] = num[k] / red[(e / HD) * ATT_WG];  // reduce_heads left the sums there
    }
}

// Split `part` (of `parts`) of row r, kv head j (the work-group (j, r, part) of attention_decode_fused); always
// inlined, as prefill_block.
inline __attribute__((always_inline)) void decode_row(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off, __global CACHE_T* k_cache,
    __global CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq, int n_heads, int qkv_dim,
    __global float* out, int out_off, float score_scale, __global float* partial, int partial_off,
    __global int* counters, int counters_off, const int j, const int r, const int part, const int parts,
    __local cvec* q_heads, __local float* tile_dots, __local float* pw, __local float* red, __local cvec* pv,
    __local int* merging) {
    const int lid = get_local_id(0);
    const int pos = positions[r], slot = slots[r], half_d = HD / 2, lo = WINDOW_START(pos);
    const int run = ((pos - lo + parts) / parts + 15) & ~15;  // ceil((pos + 1 - lo) / parts), rounded up to 16
    const int first = lo + part * run, count = clamp(pos + 1 - first, 0, run);
    const int row_at = qkv_off + r * qkv_dim;
    const size_t base = cache_index(layer, slot, j, first, n_slots, n_kv, max_seq, HD);
    __local float* qf = (__local float*)q_heads;
    for (int e = lid; e < GROUP * half_d; e += ATT_WG) {
        const int g = e / half_d, i = e % half_d, q_at = row_at + (j * GROUP + g) * HD;
        const float c = cos_t[cos_off + pos * half_d + i], s = sin_t[sin_off + pos * half_d + i];
        const float x1 = qkv[q_at + i], x2 = qkv[q_at + i + half_d];
        qf[g * HD + i] = (x1 * c - x2 * s) * score_scale;
        qf[g * HD + i + half_d] = (x2 * c + x1 * s) * score_scale;
    }
    if (count > 0 && first + count == pos + 1) {  // this run ends at the new token: store its k and v
        const int k_at = row_at + n_heads * HD + j * HD, v_at = k_at + n_kv * HD;
        const size_t at = base + (size_t)(pos - first) * HD;
        for (int i = lid; i < half_d; i += ATT_WG) {
            const float c = cos_t[cos_off + pos * half_d + i], s = sin_t[sin_off + pos * half_d + i];
            const float k1 = qkv[k_at + i], k2 = qkv[k_at + i + half_d];
            STORE_C(k1 * c - k2 * s, at + i, k_cache);
            STORE_C(k2 * c + k1 * s, at + i + half_d, k_cache);
            STORE_C(qkv[v_at + i], at + i, v_cache);
            STORE_C(qkv[v_at + i + half_d], at + i + half_d, v_cache);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);  // q in place, the new k and v readable here
    // Scores, a tile at a time: work-item lid takes lane lid % KL of key lid / KL of each pass.
    const int lane = lid % KL, key_of_pass = lid / KL;
    for (int t0 = 0; t0 < count; t0 += TILE) {
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            // Past the run's end a work-item scores its last key again (ignored below): the loads need no
            // condition, so the compiler can issue every pass's loads together.
            const size_t key = base + (size_t)min(t0 + p * KPP + key_of_pass, count - 1) * HD;
            float dots[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) dots[g] = 0.0f;
#pragma unroll
            for (int u = 0; u < CHUNKS / KL; ++u) {
                const int c = lane + u * KL;
                const cvec k = LOAD_CV(key + c * CV, k_cache);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) dots[g] += cvec_dot(q_heads[g * CHUNKS + c], k);
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) tile_dots[(g * PASSES + p) * ATT_WG + lid] = dots[g];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int e = lid; e < GROUP * TILE; e += ATT_WG) {
            const int g = e / TILE, k = e % TILE;
            if (t0 + k < count) {
                const int at = (g * PASSES + k / KPP) * ATT_WG + (k % KPP) * KL;
                float score = 0.0f;
#pragma unroll
                for (int l = 0; l < KL; ++l) score += tile_dots[at + l];
                pw[g * MAX_SPLIT + t0 + k] = CAPPED(score, 1.0f);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    // Softmax statistics of the run, per head: its max, then e^(score - max) in place and their sum.
    float m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) m[g] = -INFINITY, l[g] = 0.0f;
    for (int s = lid; s < count; s += ATT_WG)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) m[g] = fmax(m[g], pw[g * MAX_SPLIT + s]);
    reduce_heads(red, m, 1);
    for (int s = lid; s < count; s += ATT_WG)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float e = exp(pw[g * MAX_SPLIT + s] - m[g]);
            pw[g * MAX_SPLIT + s] = e;
            l[g] += e;
        }
    reduce_heads(red, l, 0);  // its barriers also publish pw[]
    // P.V: work-item (vlane, stripe) owns vector vlane of positions stripe, stripe + STRIPES, ...
    const int vlane = lid % CHUNKS, stripe = lid / CHUNKS;
    cvec acc[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) acc[g] = (cvec)(0.0f);
    if (stripe < STRIPES) {
        const size_t at = base + vlane * CV;
#pragma unroll 4
        for (int s = stripe; s < count; s += STRIPES) {
            const cvec v = LOAD_CV(at + (size_t)s * HD, v_cache);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) acc[g] += pw[g * MAX_SPLIT + s] * v;
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        pv[lid] = acc[g];
        barrier(CLK_LOCAL_MEM_FENCE);
        const size_t row_head = (size_t)r * n_heads + j * GROUP + g;
        const size_t stats = partial_off + (row_head * parts + part) * (HD + 2);
        if (lid < CHUNKS) {
            cvec total = (cvec)(0.0f);
            for (int i = 0; i < STRIPES; ++i) total += pv[i * CHUNKS + lid];
            if (parts == 1)
                STORE_CV(total / l[g], out + out_off + row_head * HD + CV * lid);
            else
                STORE_CV(total, partial + stats + 2 + CV * lid);
        }
        if (parts > 1 && lid == 0) {
            partial[stats] = count > 0 ? m[g] : -INFINITY;
            partial[stats + 1] = count > 0 ? l[g] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (parts == 1) return;
    // Publish this split, then count it; the last of the (row, kv head) merges all of them.
    DEVICE_FENCE();
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    const size_t row_kv = (size_t)r * n_kv + j;
    if (lid == 0) *merging = atomic_inc(counters + counters_off + row_kv) == parts - 1;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*merging) return;
    DEVICE_FENCE();
    merge_splits(partial + partial_off + ((size_t)r * n_heads + j * GROUP) * parts * (HD + 2), parts,
                 out + out_off + ((size_t)r * n_heads + j * GROUP) * HD, pw, red);
    if (lid == 0) counters[counters_off + row_kv] = 0;  // ready for the next launch
}

__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1))) void attention_decode_fused(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
    __global CACHE_T* k_cache, __global CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq,
    int n_heads, int qkv_dim, __global float* out, int out_off, float score_scale,
    __global float* partial, int partial_off, __global int* counters, int counters_off) {
    DECODE_LOCALS
    decode_row(qkv, qkv_off, slots, positions, cos_t, cos_off, sin_t, sin_off, k_cache, v_cache, layer, n_slots, n_kv,
               max_seq, n_heads, qkv_dim, out, out_off, score_scale, partial, partial_off, counters, counters_off,
               get_group_id(0), get_group_id(1), get_group_id(2), get_num_groups(2), DECODE_LOCAL_ARGS);
}

// -- a mixed step's attention in one launch ----------------------------------------------------------------
// attention_mixed: a batch's decode rows (one new token each, as attention_decode_fused) and a prompt chunk of
// at most PREFILL_STORES_ROWS_MAX rows (as attention_prefill, storing its own rows) in one launch. Both are
// small, latency-bound kernels at a server's sizes (~13-15 us each per layer on the H200): side by side, their
// work-groups overlap instead of running one launch after the other. The prompt's slot is none of the decode
// rows' slots, so neither part reads what the other writes.
// Built with -DHD, -DGROUP, -DMAX_SPLIT, -DQB and -DKB. Global size (ATT_WG * n_heads, blocks + rows, splits):
// y < blocks are the prompt's row blocks (split 0 only), the rest the decode rows (x < n_kv: one work-group per
// kv head); local (ATT_WG, 1, 1).
#if defined(QB) && defined(KB)
__kernel __attribute__((reqd_work_group_size(ATT_WG, 1, 1))) void attention_mixed(
    __global const float* qkv, int qkv_off, __global const int* slots, __global const int* positions,
    __global const float* cos_t, int cos_off, __global const float* sin_t, int sin_off,
    __global CACHE_T* k_cache, __global CACHE_T* v_cache, int layer, int n_slots, int n_kv, int max_seq,
    int n_heads, int qkv_dim, __global float* out, int out_off, float score_scale,
    __global float* partial, int partial_off, __global int* counters, int counters_off,
    __global const float* prompt_qkv, int prompt_qkv_off, __global const int* prompt_slots,
    __global const int* prompt_positions, int prompt_rows, __global float* prompt_out, int prompt_out_off,
    int blocks) {
    DECODE_LOCALS
    PREFILL_LOCALS
    const int h = get_group_id(0), y = get_group_id(1), part = get_group_id(2);
    if (y < blocks) {
        if (part == 0)
            prefill_block(prompt_qkv, prompt_qkv_off, prompt_slots, prompt_positions, cos_t, cos_off, sin_t, sin_off,
                          k_cache, v_cache, layer, n_slots, n_kv, max_seq, prompt_rows, n_heads, qkv_dim, prompt_out,
                          prompt_out_off, score_scale, 1, h, y, PREFILL_LOCAL_ARGS);
    } else if (h < n_kv) {  // decode work-groups are one per kv head
        decode_row(qkv, qkv_off, slots, positions, cos_t, cos_off, sin_t, sin_off, k_cache, v_cache, layer, n_slots,
                   n_kv, max_seq, n_heads, qkv_dim, out, out_off, score_scale, partial, partial_off, counters,
                   counters_off, h, y - blocks, part, get_num_groups(2), DECODE_LOCAL_ARGS);
    }
}
#endif
#endif
