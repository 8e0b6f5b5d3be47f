// GROUP_BIAS(bias, g, s): the bias of an int4 weight's group g, whose scale is s. Stored (bias[g]), or, for a
// weight whose every bias is -8 times its scale (GGUF Q4_0, built with -DQ4_0_BIAS), derived: such a weight
// stores and reads no bias array (4 bytes per 32 weights less kept; decode speed measured the same within noise).
#ifdef Q4_0_BIAS
#define GROUP_BIAS(bias, g, s) (-8.0f * (s))
#else
#define GROUP_BIAS(bias, g, s) ((bias)[g])
#endif

