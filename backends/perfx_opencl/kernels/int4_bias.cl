// GROUP_BIAS(bias, g, s): the bias of an int4 weight's group g, whose scale is s. Stored (bias[g]), or, for a
// weight whose every bias is -8 times its scale (GGUF Q4_0, built with -DQ4_0_BIAS), derived: such a weight
// stores and reads no bias array (4 bytes per 32 weights less kept; decode speed measured the same within noise).
#ifdef Q4_0_BIAS
#define GROUP_BIAS(bias, g, s) (-8.0f * (s))
#else
#define GROUP_BIAS(bias, g, s) ((bias)[g])
#endif

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
