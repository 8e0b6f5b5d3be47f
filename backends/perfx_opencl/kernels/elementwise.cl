// Row-wise norms, the gated MLPs' activations, the other families' elementwise ops (bias, scale, soft-cap, q/k
// norm), argmax and sampling. Activations are float32; every tensor argument is a (pointer, element offset) pair.

#ifndef NORM_WG
#define NORM_WG 256  // threads per row (set by ops.py)
#endif

// The sum of ``value`` over a work-group of ``size`` threads (a power of two; a constant at every call, so the
// loop unrolls); scratch holds ``size`` floats.
inline float sum_over_group(__local float* scratch, float value, int size) {
    const int lid = get_local_id(0);
    scratch[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = size / 2; stride > 0; stride >>= 1) {
        if (lid < stride) scratch[lid] += scratch[lid + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// One work-group per row: out = x / sqrt(mean(x^2) + eps) * weight. Global size (NORM_WG * n).
__kernel __attribute__((reqd_work_group_size(NORM_WG, 1, 1))) void rmsnorm(
    __global const float* x, int x_off, __global const float* weight, int w_off, __global float* out, int out_off,
    int d, float eps) {
    __local float scratch[NORM_WG];
    const int lid = get_local_id(0);
    const int base = get_group_id(0) * d;
    float sq = 0.0f;
    for (int c = lid; c < d; c += NORM_WG) {
        const float v = x[x_off + base + c];
        sq += v * v;
    }
    const float inv = 1.0f / sqrt(sum_over_group(scratch, sq, NORM_WG) / (float)d + eps);
    for (int c = lid; c < d; c += NORM_WG) out[out_off + base + c] = x[x_off + base + c] * inv * weight[w_off + c];
}

// residual += x (in place), then out = rmsnorm(residual): one row per work-group (add_norm_tail.cl's
// add_rmsnorm_token, whose loads come in blocks: a load-add-store loop waited a memory round trip per element).
__kernel __attribute__((reqd_work_group_size(NORM_WG, 1, 1))) void add_rmsnorm(
    __global const float* x, int x_off, __global float* residual, int r_off, __global const float* weight,
    int w_off, __global float* out, int out_off, int d, float eps) {
    __local float scratch[NORM_WG];
    const size_t base = (size_t)get_group_id(0) * d;
    add_rmsnorm_token(x + x_off + base, 0, residual + r_off + base, weight + w_off, out + out_off + base, d, eps,
                      scratch, get_local_id(0), NORM_WG);
}

// residual += rmsnorm(x) * post_w (in place), then out = rmsnorm(residual) * weight: linear_post_norm_add_rmsnorm
// after a matmul that could not take the tail. One row per work-group.
__kernel __attribute__((reqd_work_group_size(NORM_WG, 1, 1))) void post_norm_add_rmsnorm(
    __global const float* x, int x_off, __global const float* post_w, int p_off, __global float* residual, int r_off,
    __global const float* weight, int w_off, __global float* out, int out_off, int d, float eps) {
    __local float scratch[NORM_WG];
    const size_t base = (size_t)get_group_id(0) * d;
    add_rmsnorm_token(x + x_off + base, post_w + p_off, residual + r_off + base, weight + w_off, out + out_off + base,
                      d, eps, scratch, get_local_id(0), NORM_WG);
}

// out (n, f) = silu(gate_up[:, :f]) * gate_up[:, f:] (gate_activation.cl). Global size (f, n).
__kernel void silu_mul(__global const float* gate_up, int gu_off, __global float* out, int out_off, int f) {
    const int c = get_global_id(0), row = get_global_id(1);
    if (c >= f) return;
    const size_t at = gu_off + (size_t)row * 2 * f + c;
    out[out_off + (size_t)row * f + c] = silu(gate_up[at]) * gate_up[at + f];
}

// out (n, f) = gelu_tanh(gate_up[:, :f]) * gate_up[:, f:]: GeGLU's activation. Global size (f, n).
__kernel void gelu_mul(__global const float* gate_up, int gu_off, __global float* out, int out_off, int f) {
    const int c = get_global_id(0), row = get_global_id(1);
    if (c >= f) return;
    const size_t at = gu_off + (size_t)row * 2 * f + c;
    out[out_off + (size_t)row * f + c] = gelu_tanh(gate_up[at]) * gate_up[at + f];
}

// -- the ops of families beyond Llama ------------------------------------------------------------------------

// out (n, m) = x + bias (Qwen2's q/k/v biases). Global size (m, n).
__kernel void add_bias(__global const float* x, int x_off, __global const float* bias, int b_off,
                       __global float* out, int out_off, int m) {
    const int c = get_global_id(0), row = get_global_id(1);
    if (c >= m) return;
    const size_t at = (size_t)row * m + c;
    out[out_off + at] = x[x_off + at] + bias[b_off + c];
}

// out[:, start:start + m] = x (n, m), out's other columns untouched (a matmul by row parts). Global size (m, n).
__kernel void write_columns(__global const float* x, int x_off, __global float* out, int out_off, int m, int width,
                            int start) {
    const int c = get_global_id(0), row = get_global_id(1);
    if (c >= m) return;
    out[out_off + (size_t)row * width + start + c] = x[x_off + (size_t)row * m + c];
}

// out = x * factor over ``count`` elements (Gemma's embedding scale). Global size (count).
__kernel void scale(__global const float* x, int x_off, __global float* out, int out_off, int count, float factor) {
    const int i = get_global_id(0);
    if (i < count) out[out_off + i] = x[x_off + i] * factor;
}

// out = cap * tanh(x / cap) over ``count`` elements (Gemma 2's logit soft-capping). Global size (count).
__kernel void softcap(__global const float* x, int x_off, __global float* out, int out_off, int count, float cap) {
    const int i = get_global_id(0);
    if (i < count) out[out_off + i] = cap * tanh(x[x_off + i] / cap);
}

#ifndef HEAD_WG
#define HEAD_WG 64  // threads per head of head_rmsnorm (set by ops.py)
#endif

// qkv (n, qkv_dim) with its q heads RMS-normed by q_weight (head_dim,), its k heads by k_weight, its v copied:
// the q/k norm of Gemma 3 and Qwen3. One work-group per (head, row): groups 0..n_heads-1 take the q heads, the
// next n_kv_heads the k heads, the last n_kv_heads the v heads. Global size (HEAD_WG * heads, n).
__kernel __attribute__((reqd_work_group_size(HEAD_WG, 1, 1))) void head_rmsnorm(
    __global const float* qkv, int qkv_off, __global const float* q_weight, int qw_off,
    __global const float* k_weight, int kw_off, __global float* out, int out_off, int head_dim, int n_heads,
    int n_kv_heads, float eps) {
    __local float scratch[HEAD_WG];
    const int lid = get_local_id(0), head = get_group_id(0);
    const size_t base = (size_t)get_group_id(1) * (n_heads + 2 * n_kv_heads) * head_dim + (size_t)head * head_dim;
    __global const float* x = qkv + qkv_off + base;
    __global float* y = out + out_off + base;
    // A v head sums too and drops the sum, so every work-group reaches the same barriers: PoCL 3.1 crashed on this
    // kernel when the v heads' work-groups returned before them.
    const bool copy = head >= n_heads + n_kv_heads;
    __global const float* w = head < n_heads ? q_weight + qw_off : k_weight + kw_off;
    float sq = 0.0f;
    for (int c = lid; c < head_dim; c += HEAD_WG) sq += x[c] * x[c];
    const float inv = 1.0f / sqrt(sum_over_group(scratch, sq, HEAD_WG) / (float)head_dim + eps);
    for (int c = lid; c < head_dim; c += HEAD_WG) y[c] = copy ? x[c] : x[c] * inv * w[c];
}

// -- argmax --------------------------------------------------------------------------------------------------
#ifndef ARGMAX_WG
#define ARGMAX_WG 256
#endif

// Does (v, i) beat (best, at)? As NumPy's argmax: NaN beats everything, ties go to the lower index; an index
// of -1 means "nothing" (a thread that saw no element), which never beats and is always beaten.
inline bool beats(float v, int i, float best, int at) {
    if (i < 0) return false;
    if (at < 0) return true;
    if (isnan(v)) return !isnan(best) || i < at;
    if (isnan(best)) return false;
    return v > best || (v == best && i < at);
}

// The winning index of a work-group whose threads hold (best, at) candidates (beats() decides); local arrays
// of ARGMAX_WG entries.
inline int group_argmax(float best, int at, __local float* best_v, __local int* best_i) {
    const int lid = get_local_id(0);
    best_v[lid] = best;
    best_i[lid] = at;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = ARGMAX_WG / 2; stride > 0; stride >>= 1) {
        if (lid < stride && beats(best_v[lid + stride], best_i[lid + stride], best_v[lid], best_i[lid])) {
            best_v[lid] = best_v[lid + stride];
            best_i[lid] = best_i[lid + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return best_i[0];
}

// out[row] = the first index of the largest value of each row of x (n, vocab). Global size (ARGMAX_WG * n):
// one work-group per row, so a decode step sends back n ids instead of n x vocab logits.
__kernel __attribute__((reqd_work_group_size(ARGMAX_WG, 1, 1))) void argmax_rows(
    __global const float* x, int x_off, __global int* out, int out_off, int vocab) {
    __local float best_v[ARGMAX_WG];
    __local int best_i[ARGMAX_WG];
    const int lid = get_local_id(0), row = get_group_id(0);
    __global const float* values = x + x_off + (size_t)row * vocab;
    float best = 0.0f;
    int at = -1;
    for (int i = lid; i < vocab; i += ARGMAX_WG) {
        const float v = values[i];
        if (beats(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    const int winner = group_argmax(best, at, best_v, best_i);
    if (lid == 0) out[out_off + row] = winner;
}

// -- sampling ------------------------------------------------------------------------------------------------
// One token per row drawn on the device, as perfx_core.sampling.engine_draw defines it: rows[r] = (float bits
// of the temperature, float bits of min_p, seed, step, top_k, float bits of top_p). Temperature 0: the argmax.
// Otherwise the argmax of (logits - max) / T + Gumbel noise over the tokens top-k, top-p and min-p keep
// (sampling.engine_keep: thresholds on the tempered values, found here by bisecting the values' bits instead of
// sorting), an exact draw from the tempered softmax; the noise comes from a hash of (seed, step, token index),
// so a seeded sequence repeats on any backend.
#define SAMPLE_ROW 6
inline uint mix32(uint x) {  // lowbias32
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

// uint keys in the order of the float values; NaN is 0, below every value (sampling._order_keys).
inline uint order_key(float v) {
    const uint b = as_uint(v);
    return isnan(v) ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Over a row's tempered values (values - top) / T whose keys are at or above floor_key (NaN never): the sum of
// their exp, over the whole work-group.
inline float tally_from(__global const float* values, int vocab, float top, float temperature, uint floor_key,
                        __local float* scratch) {
    float total = 0.0f;
    for (int i = get_local_id(0); i < vocab; i += ARGMAX_WG) {
        const float v = (values[i] - top) / temperature;
        const uint k = order_key(v);
        if (k > 0u && k >= floor_key) total += exp(v);
    }
    return sum_over_group(scratch, total, ARGMAX_WG);
}

// Top-p's part of the mass: a value whose share is within float rounding of top_p counts as reaching it.
#define NUCLEUS_TARGET(top_p, mass) ((top_p) * (mass) * (1.0f - 0x1p-20f))  // sampling.TOP_P_SLACK

// The largest key (not below floor_key) whose tally from it up reaches target: a bisection over its 32 bits,
// one pass over the row per bit. (Top-p when top-k kept too many tokens to gather, or is off.)
inline uint largest_key_reaching(__global const float* values, int vocab, float top, float temperature,
                                 uint floor_key, float target, __local float* scratch) {
    uint key = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint candidate = key | (1u << bit);
        if (tally_from(values, vocab, top, temperature, max(candidate, floor_key), scratch) >= target)
            key = candidate;
    }
    return key;
}

// The k-th largest key of the row's tempered values (0 when fewer than k are not NaN): what the bisection
// above finds for counts, in 4 passes instead of 32. Pass p counts the values that share the key's bytes
// found so far by their next byte (a 256-bin histogram in local memory) and keeps the byte where the count
// from the top reaches the rank still wanted. Counts are integers, so the result is exactly the bisection's.
#define RADIX_BINS 256
#if ARGMAX_WG < RADIX_BINS
#error "sample_rows keeps its radix bins in best_i: ARGMAX_WG must be at least RADIX_BINS"
#endif
inline uint kth_largest_key(__global const float* values, int vocab, float top, float temperature, int k,
                            __local int* bins, __local int* chosen) {
    const int lid = get_local_id(0);
    uint prefix = 0, mask = 0;
    int wanted = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = lid; b < RADIX_BINS; b += ARGMAX_WG) bins[b] = 0;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = lid; i < vocab; i += ARGMAX_WG) {
            const uint key = order_key((values[i] - top) / temperature);
            if (key > 0u && (key & mask) == prefix) atomic_inc(&bins[(key >> shift) & 0xFFu]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid == 0) {  // 256 bins: a serial walk from the top is cheaper than another barrier ladder
            int above = 0, byte = RADIX_BINS - 1;
            while (byte >= 0 && above + bins[byte] < wanted) above += bins[byte--];
            chosen[0] = byte, chosen[1] = wanted - above;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        const int byte = chosen[0];
        wanted = chosen[1];
        barrier(CLK_LOCAL_MEM_FENCE);  // chosen is rewritten by the next pass
        if (byte < 0) return 0u;  // fewer than k values: no filter
        prefix |= (uint)byte << shift, mask |= 0xFFu << shift;
    }
    return prefix;
}

// Top-p over what top-k kept, when that fits SAMPLE_KEPT values: each work-item gathers its own kept values
// (tempered) into local memory, in the order it visits them, so every sum below adds the same terms in the
// same order as the passes over the whole row do (tally_from) and gives the same threshold, bit for bit;
// the bisection then reads local memory instead of the row. Returns 0 without touching the row's threshold
// when too many were kept (the caller falls back to the row passes).
#ifndef SAMPLE_KEPT
#define SAMPLE_KEPT 1024
#endif
inline uint nucleus_key_kept(__global const float* values, int vocab, float top, float temperature, uint floor_key,
                             float top_p, __local float* kept, __local int* offsets, __local float* scratch,
                             int* fits) {
    const int lid = get_local_id(0);
    int mine = 0;
    for (int i = lid; i < vocab; i += ARGMAX_WG) {
        const uint key = order_key((values[i] - top) / temperature);
        mine += key > 0u && key >= floor_key;
    }
    offsets[lid] = mine;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {  // exclusive prefix sums of the work-items' counts; the total last
        int total = 0;
        for (int t = 0; t < ARGMAX_WG; ++t) {
            const int c = offsets[t];
            offsets[t] = total;
            total += c;
        }
        offsets[ARGMAX_WG] = total;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    *fits = offsets[ARGMAX_WG] <= SAMPLE_KEPT;
    if (!*fits) return 0u;
    const int begin = offsets[lid];
    int at = begin;
    for (int i = lid; i < vocab; i += ARGMAX_WG) {
        const float v = (values[i] - top) / temperature;
        const uint key = order_key(v);
        if (key > 0u && key >= floor_key) kept[at++] = v;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // The mass over what was kept, then the bisection: the tally from a candidate key is each work-item's sum
    // over its own kept values (as tally_from's), summed over the work-group.
    float mass = 0.0f;
    for (int j = begin; j < at; ++j) mass += exp(kept[j]);
    mass = sum_over_group(scratch, mass, ARGMAX_WG);
    const float target = NUCLEUS_TARGET(top_p, mass);
    uint key = 0;
    for (int bit = 31; bit >= 0; --bit) {
        const uint candidate = max(key | (1u << bit), floor_key);
        float total = 0.0f;
        for (int j = begin; j < at; ++j) total += order_key(kept[j]) >= candidate ? exp(kept[j]) : 0.0f;
        if (sum_over_group(scratch, total, ARGMAX_WG) >= target) key = key | (1u << bit);
    }
    return key;
}

// Global size (ARGMAX_WG * n): one work-group per row.
__kernel __attribute__((reqd_work_group_size(ARGMAX_WG, 1, 1))) void sample_rows(
    __global const float* x, int x_off, __global const int* rows, __global int* out, int out_off, int vocab) {
    __local float best_v[ARGMAX_WG];
    __local int best_i[ARGMAX_WG];  // also the radix bins of kth_largest_key (ARGMAX_WG >= RADIX_BINS)
    __local int radix_chosen[2];
    __local float kept[SAMPLE_KEPT];
    __local int kept_offsets[ARGMAX_WG + 1];
    const int lid = get_local_id(0), row = get_group_id(0);
    __global const float* values = x + x_off + (size_t)row * vocab;
    __global const int* params = rows + SAMPLE_ROW * row;
    const float temperature = as_float(params[0]), min_p = as_float(params[1]), top_p = as_float(params[5]);
    const int top_k = params[4];
    const uint key = mix32((uint)params[2] ^ mix32((uint)params[3] * 0x9e3779b9U + 0x632be5abU));
    // Pass 1 (a draw): the largest logit, subtracted before dividing by T so tiny temperatures stay finite.
    float top = 0.0f;
    if (temperature > 0.0f) {
        float m = -INFINITY;
        for (int i = lid; i < vocab; i += ARGMAX_WG) m = fmax(m, values[i]);  // fmax skips NaN
        best_v[lid] = m;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int stride = ARGMAX_WG / 2; stride > 0; stride >>= 1) {
            if (lid < stride) best_v[lid] = fmax(best_v[lid], best_v[lid + stride]);
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        top = isinf(best_v[0]) ? 0.0f : best_v[0];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    // Top-k: the largest key with at least k values at or above it is the k-th largest value (k past the
    // number of values leaves 0: no filter). Top-p, over what top-k kept: the largest key whose values at or
    // above it hold top_p of that mass.
    uint threshold = 0;
    if (temperature > 0.0f && top_k > 0)
        threshold = kth_largest_key(values, vocab, top, temperature, top_k, best_i, radix_chosen);
    if (temperature > 0.0f && top_p < 1.0f) {
        int fits = 0;
        uint nucleus = 0;
        if (top_k > 0)
            nucleus = nucleus_key_kept(values, vocab, top, temperature, threshold, top_p, kept, kept_offsets, best_v,
                                       &fits);
        if (!fits) {
            const float mass = tally_from(values, vocab, top, temperature, threshold, best_v);
            nucleus = largest_key_reaching(values, vocab, top, temperature, threshold, NUCLEUS_TARGET(top_p, mass),
                                           best_v);
        }
        threshold = max(threshold, nucleus);
    }
    const float cut = min_p > 0.0f ? log(min_p) : -INFINITY;
    // Last pass: the argmax of the keys (the logits themselves when greedy). A NaN logit never wins a draw.
    float best = 0.0f;
    int at = -1;
    for (int i = lid; i < vocab; i += ARGMAX_WG) {
        float v = values[i];
        if (temperature > 0.0f) {
            const float scaled = (v - top) / temperature;
            const uint k = order_key(scaled);
            // 23 random bits: (bits + 0.5) / 2^23 is exact and strictly inside (0, 1).
            const float u = ((float)(mix32(key ^ ((uint)i * 0x85ebca6bU)) >> 9) + 0.5f) * (1.0f / 8388608.0f);
            v = k > 0u && k >= threshold && scaled >= cut ? scaled - log(-log(u)) : -INFINITY;
        }
        if (beats(v, i, best, at)) {
            best = v;
            at = i;
        }
    }
    const int winner = group_argmax(best, at, best_v, best_i);
    if (lid == 0) out[out_off + row] = winner;
}
