// The activation of a gated MLP's gate half, shared by the fused gate-up matmuls (int4.cl, int4_mma.cl, int8.cl,
// built with -DSILU) and the elementwise kernels: SiLU (SwiGLU), or tanh-approximated GELU (GeGLU) with -DGELU.
// g / (1 + exp(-g)) is finite for any g (exp -> inf gives -0); tanh saturates, so gelu_tanh is finite too.
inline float silu(float g) { return g / (1.0f + exp(-g)); }

inline float gelu_tanh(float g) { return 0.5f * g * (1.0f + tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))); }

#ifdef GELU
#define GATE_ACTIVATION(g) gelu_tanh(g)
#else
#define GATE_ACTIVATION(g) silu(g)
#endif
