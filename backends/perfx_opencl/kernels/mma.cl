// Matrix units for the kernels that use them (int4_mma.cl, attention_mma.cl): mma m16n8k16 on half inputs
// with float accumulation, and a swap of values between the lanes of a warp.
//
// On NVIDIA (-DNV_MMA, probed by the runtime) these are `mma.sync` and `shfl.sync` through inline PTX.
// Elsewhere a portable emulation through local memory computes the same fragments with the same roundings:
// how CI checks the kernels' data layout on PoCL (far too slow to be chosen there by default). The
// emulation's helpers take a per-warp scratch of MMA_SCRATCH floats and contain barriers, so every work-item
// of a work-group must call them equally often.
//
// Fragments, for lane = 4 * g + t: A (16 x 16, row-major) a0 = row g, k 2t and 2t+1 (low half first),
// a1 = row g + 8 at the same k, a2 = row g at k 2t+8, 2t+9, a3 = row g + 8 there; B (16 x 8) b0 = k 2t, 2t+1
// of column g, b1 = k 2t+8, 2t+9; C (16 x 8) c[0], c[1] = row g, columns 2t, 2t+1 and c[2], c[3] = row g + 8.

#define MMA_SCRATCH (256 + 128)  // floats per warp the emulation needs: A, then B

#ifdef NV_MMA
inline uint half2_of(float lo, float hi) {
    uint r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
inline void mma_16816(float* c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#define MMA(c, a0, a1, a2, a3, b0, b1) mma_16816(c, a0, a1, a2, a3, b0, b1)
// The value of lane ^ mask (a butterfly within the warp).
inline float lane_xor(float v, int mask, int scratch, int lane) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(mask));
    return r;
}
#define LANE_XOR(v, mask) lane_xor((v), (mask), 0, lane)
#else
// Halves through vload_half / vstore_half_rte (no cl_khr_fp16 needed), rounding as cvt.rn does.
inline float half_value(uint bits) {
    const ushort h = (ushort)bits;
    return vload_half(0, (const half*)&h);
}
inline uint half_bits(float v) {
    ushort h;
    vstore_half_rte(v, 0, (half*)&h);
    return h;
}
inline uint half2_of(float lo, float hi) { return half_bits(lo) | (half_bits(hi) << 16); }
// The warp's A (16 x 16) and B (16 x 8) gathered into local memory, then each lane computes its four outputs.
inline void mma_emulated(float* c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1, __local float* a,
                         int lane) {
    __local float* b = a + 256;
    const int g = lane >> 2, t = lane & 3;
    a[g * 16 + 2 * t] = half_value(a0), a[g * 16 + 2 * t + 1] = half_value(a0 >> 16);
    a[(g + 8) * 16 + 2 * t] = half_value(a1), a[(g + 8) * 16 + 2 * t + 1] = half_value(a1 >> 16);
    a[g * 16 + 2 * t + 8] = half_value(a2), a[g * 16 + 2 * t + 9] = half_value(a2 >> 16);
    a[(g + 8) * 16 + 2 * t + 8] = half_value(a3), a[(g + 8) * 16 + 2 * t + 9] = half_value(a3 >> 16);
    b[(2 * t) * 8 + g] = half_value(b0), b[(2 * t + 1) * 8 + g] = half_value(b0 >> 16);
    b[(2 * t + 8) * 8 + g] = half_value(b1), b[(2 * t + 9) * 8 + g] = half_value(b1 >> 16);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int kk = 0; kk < 16; ++kk) {
        const float lo = a[g * 16 + kk], hi = a[(g + 8) * 16 + kk];
        const float x0 = b[kk * 8 + 2 * t], x1 = b[kk * 8 + 2 * t + 1];
        c[0] = fma(lo, x0, c[0]), c[1] = fma(lo, x1, c[1]), c[2] = fma(hi, x0, c[2]), c[3] = fma(hi, x1, c[3]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#define MMA(c, a0, a1, a2, a3, b0, b1) mma_emulated(c, a0, a1, a2, a3, b0, b1, mma_scratch, lane)
inline float lane_xor(float v, int mask, __local float* scratch, int lane) {
    scratch[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    const float r = scratch[lane ^ mask];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}
#define LANE_XOR(v, mask) lane_xor((v), (mask), mma_scratch, lane)
#endif
