// Prepended to every kernel file after device_fence.cl (runtime.py program): residual add + RMSNorm of one
// token by a work-group (elementwise.cl's add_rmsnorm), and with -DADD_NORM the tail with which a matmul kernel
// (int4.cl's GEMV, int4_mma.cl) finishes linear_add_rmsnorm itself: once every work-group has written its part
// of delta = x @ W.T, residual (n, d) += delta and normed = rmsnorm(residual) * norm_w, which saves the
// add_rmsnorm launch (on the H200 a launch costs ~5-10 us, the kernel's own work ~1 us at decode sizes). With
// -DPOST_NORM as well (linear_post_norm_add_rmsnorm: Gemma's norm of a block part's output), delta is first
// RMS-normed by post_w, which saves a launch more.
//
// Who does the tail: the last `finishers` work-groups to finish their tiles (an atomic ticket each), finisher f
// taking tokens f, f + finishers, ... With one finisher it is the last work-group, which runs when all others
// are done. With more, a finisher waits for the last ticket: the host allows that only where the work-groups
// of a launch run concurrently (NVIDIA), and with fewer finishers than compute units, so the work-groups that
// a finisher waits for are running or can be scheduled.
//
// counter[0] counts tickets, counter[1] finishers done; both are zero before the launch, and the last
// finisher to be done sets them back to zero (a recorded launch is replayed as is).
#define TAIL_BLOCK 16  // elements a work-item loads before it stores any: their loads overlap

// The sum of `value` over the `size` work-items of a group (every one gets it); scratch holds `size` floats.
inline float sum_in_group(__local float* scratch, float value, int tid, int size) {
    scratch[tid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    int width = 1;
    while (width < size) width <<= 1;
    for (int stride = width / 2; stride > 0; stride >>= 1) {
        if (tid < stride && tid + stride < size) scratch[tid] += scratch[tid + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float total = scratch[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// residual (d) += delta; normed = rmsnorm(residual) * norm_w for one token, by all `size` work-items of a group;
// where post_w is not null, delta is rmsnorm(delta) * post_w (the callers without a post-norm pass a literal 0,
// so their code compiles as if this did not exist).
// The loads come in blocks, all issued before the block's stores: a store may alias the next load as far as the
// compiler knows, so a load-add-store loop waited out a memory round trip per element (on the H200 that made
// the tail slower than the add_rmsnorm launch it replaces). Where one block covers the token (d <= TAIL_BLOCK *
// size: a 7B model's 4096 with 256 work-items), norm_w loads with residual and delta and the sums stay in
// registers for the second pass, so the tail waits out one memory round trip instead of two.
// In the tail other work-groups wrote delta, and it is
// read with plain loads: each writer fences (DEVICE_FENCE) before its atomic ticket, and a finisher reads the
// counter that the last ticket set, then fences, before loading. That is the release/acquire pattern of PTX's
// memory model (membar.gl is fence.sc.gpu; the volatile read and the atomics are strong), which orders plain
// accesses too; PoCL's threads are coherent.
inline void add_rmsnorm_token(__global const float* delta, __global const float* post_w, __global float* residual,
                              __global const float* norm_w, __global float* normed, int d, float eps,
                              __local float* scratch, int tid, int size) {
    if (d <= TAIL_BLOCK * size) {
        float sum[TAIL_BLOCK], add[TAIL_BLOCK], w[TAIL_BLOCK], post[TAIL_BLOCK], sq = 0.0f;
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = tid + u * size;
            sum[u] = c < d ? residual[c] : 0.0f;
            add[u] = c < d ? delta[c] : 0.0f;
            w[u] = c < d ? norm_w[c] : 0.0f;
            if (post_w) post[u] = c < d ? post_w[c] : 0.0f;
        }
        if (post_w) {
            float add_sq = 0.0f;
#pragma unroll
            for (int u = 0; u < TAIL_BLOCK; ++u) add_sq += add[u] * add[u];
            const float inv = 1.0f / sqrt(sum_in_group(scratch, add_sq, tid, size) / (float)d + eps);
#pragma unroll
            for (int u = 0; u < TAIL_BLOCK; ++u) add[u] *= inv * post[u];
        }
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) sum[u] += add[u];
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = tid + u * size;
            if (c < d) residual[c] = sum[u];
            sq += sum[u] * sum[u];
        }
        const float inv = 1.0f / sqrt(sum_in_group(scratch, sq, tid, size) / (float)d + eps);
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = tid + u * size;
            if (c < d) normed[c] = sum[u] * inv * w[u];
        }
        return;
    }
    float post_inv = 1.0f;
    if (post_w) {
        float add_sq = 0.0f;
        for (int c = tid; c < d; c += size) add_sq += delta[c] * delta[c];
        post_inv = 1.0f / sqrt(sum_in_group(scratch, add_sq, tid, size) / (float)d + eps);
    }
    float sq = 0.0f;
    for (int first = tid; first < d; first += TAIL_BLOCK * size) {
        float sum[TAIL_BLOCK];
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = first + u * size;
            const float add = c < d ? delta[c] : 0.0f;
            sum[u] = c < d ? residual[c] + (post_w ? add * post_inv * post_w[c] : add) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = first + u * size;
            if (c < d) residual[c] = sum[u];
            sq += sum[u] * sum[u];
        }
    }
    const float inv = 1.0f / sqrt(sum_in_group(scratch, sq, tid, size) / (float)d + eps);
    for (int first = tid; first < d; first += TAIL_BLOCK * size) {
        float value[TAIL_BLOCK];
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = first + u * size;
            value[u] = c < d ? residual[c] * inv * norm_w[c] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < TAIL_BLOCK; ++u) {
            const int c = first + u * size;
            if (c < d) normed[c] = value[u];
        }
    }
}

#ifdef ADD_NORM
#ifdef POST_NORM
#define POST_NORM_ARGS , __global const float *post_w, int post_w_off
#define POST_W (post_w + post_w_off)
#else
#define POST_NORM_ARGS
#define POST_W 0
#endif
#define EPILOGUE_ARGS                                                                                          \
    , __global float *residual, int residual_off, __global const float *norm_w, int norm_w_off,               \
        __global float *normed, int normed_off, float eps, __global int *counter, int counter_off,             \
        int finishers POST_NORM_ARGS

// Called by every work-item of every work-group once its outputs (delta, n x d) are stored. scratch holds
// `size` floats; ticket is one local int; post_w is POST_W.
inline void add_norm_tail(__global const float* delta, __global const float* post_w, __global float* residual,
                          __global const float* norm_w, __global float* normed, int n, int d, float eps,
                          __global int* counter, int finishers, __local float* scratch, __local int* ticket, int tid,
                          int size) {
    const int groups = get_num_groups(0) * get_num_groups(1);
    DEVICE_FENCE();  // this work-item's outputs reach memory before the group takes its ticket
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (tid == 0) *ticket = atomic_inc(counter);
    barrier(CLK_LOCAL_MEM_FENCE);
    const int finisher = *ticket - (groups - finishers);
    if (finisher < 0) return;  // uniform over the group
    if (tid == 0)  // until the last ticket, when every group's delta is stored (at once for the last finisher)
        while (*(volatile __global const int*)counter < groups) {
        }
    barrier(CLK_LOCAL_MEM_FENCE);
    DEVICE_FENCE();
    for (int t = finisher; t < n; t += finishers)
        add_rmsnorm_token(delta + (size_t)t * d, post_w, residual + (size_t)t * d, norm_w, normed + (size_t)t * d, d,
                          eps, scratch, tid, size);
    if (tid == 0 && atomic_inc(counter + 1) == finishers - 1) counter[0] = counter[1] = 0;  // all past the wait
}
#else
#define EPILOGUE_ARGS
#endif
