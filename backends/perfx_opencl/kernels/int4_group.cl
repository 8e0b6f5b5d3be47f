// int4_group(scale, bias, grp, row, m): (scale, bias) of row's group grp as floats; scale holds float16 bits and
// bias float32, both [group][row]. Two weight forms keep less. One whose every bias is -8 times its scale (GGUF
// Q4_0, built with -DQ4_0_BIAS) stores and reads no bias array (4 bytes per 32 weights less; decode speed measured
// the same within noise). One built with -DQ4_K_FACTORS keeps a GGUF Q4_K's own factors (the file's 0.5625 bytes
// per weight, not 0.6875): scale holds sc | m << 8 per 32-column group and bias the float16 bits of d | -dmin << 16
// per 256 columns (dmin negated once at load, not per group in the matrix-unit kernel); the group's scale is d * sc
// and its bias -dmin * m, exact in float32 (11-bit times 6-bit significands), as llama.cpp and the host's
// Int4KScales compute them.
inline float2 int4_group(__global const ushort* scale, __global const float* bias, size_t grp, size_t row, size_t m) {
#ifdef Q4_K_FACTORS
    const uint f = scale[grp * m + row];
    const float2 dd = vload_half2((grp >> 3) * m + row, (__global const half*)bias);
    // 0x4B000000 | v is the float 2^23 + v: sc and m without an int-to-float conversion (quarter-rate on NVIDIA)
    const float sc = as_float(0x4B000000u | (f & 0xFFu)) - 8388608.0f, mins = as_float(0x4B000000u | (f >> 8)) - 8388608.0f;
    return (float2)(dd.x * sc, dd.y * mins);  // dd.y is -dmin
#else
    const size_t g = grp * m + row;
    const float s = vload_half(g, (__global const half*)scale);
#ifdef Q4_0_BIAS
    return (float2)(s, -8.0f * s);
#else
    return (float2)(s, bias[g]);
#endif
#endif
}

// An int4 weight's arrays come as (buffer, offset) pairs, packed_off in bytes, scale_off in scales and bias_off
// in floats: a layer's weights share one buffer (runtime.py prepare_weights), since NVIDIA's driver rounds every
// buffer over 1 MiB up to 2 MiB (145 MiB of a 7B Q4_0's 3.6 GB, one buffer per array). PT and ST are the
// kernel's types for the codes and the scales; INT4_WEIGHT_AT moves the pointers to the weight.
#define INT4_WEIGHT_PARAMS(PT, ST)                                                                        \
    __global const PT *packed, int packed_off, __global const ST *scale, int scale_off, __global const float *bias, \
        int bias_off
#define INT4_WEIGHT_AT(PT)                                                       \
    packed += (uint)packed_off / (uint)sizeof(PT);                            \
    scale += scale_off;                                                          \
    bias += bias_off
