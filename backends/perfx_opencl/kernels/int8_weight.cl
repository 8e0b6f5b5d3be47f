// int8 weights (perfx_core.weights.Int8Weight: GGUF Q8_0, Q5_0, Q6_K): W[r, c] = code[r, c] * scale[r, c / g].
// Put before int8.cl and int8_gemm.cl (kernel_source.py FILE_PRELUDES).
//
// Layout on the device (re-packed once at load, runtime.py prepare_weight), chunk-major like int4.cl's:
//   codes: uint4 (k/16, m): element [c][r] holds the 16 codes of row r, columns 16c .. 16c+15; byte i of the 16 is
//          column 16c + i, as the host holds them, so re-packing is a transpose of 16-byte chunks. Consecutive
//          threads take consecutive rows: a warp's loads are one contiguous 512-byte run.
//   scale: (k/g, m), float16 bits (read with vload_half: no cl_khr_fp16 needed), or float32 with -DSCALE_F32 (GGUF
//          Q6_K: its float16 d times an int8 sub-scale, exact only in float32).
// g is 16, 32, 64 or 128, so a chunk never spans two groups.

#ifdef SCALE_F32
#define SCALE_T float
#define LOAD_SCALE(g, scale) ((scale)[g])
#else
#define SCALE_T half
#define LOAD_SCALE(g, scale) vload_half((g), (scale))
#endif

// Byte -> float without an int-to-float conversion (int4.cl's trick for nibbles): flipping the sign bit makes
// code + 128 an unsigned byte u; masked in place into 0x4B000000 it is the float 2^23 + u * 256^p, and subtracting
// 2^23 + 128 * 256^p leaves code * 256^p exactly. Bytes 0 and 1 of a word are masked in place (p = 0, 1), bytes 2
// and 3 after a 16-bit shift; the 256^-p goes into the final combination (exact: a power of two).
#define I8_MAGIC 0x4B000000u
#define I8_MASK ((uint4)(0xFFu, 0xFF00u, 0xFFu, 0xFF00u))
#define I8_OFFSET ((float4)(8388736.0f, 8421376.0f, 8388736.0f, 8421376.0f))  // 2^23 + 128, 2^23 + 32768
#define I8_UNSCALE ((float4)(1.0f, 0.00390625f, 1.0f, 0.00390625f))

// The 4 codes of a word (columns 4j .. 4j+3 for word j of a chunk), times I8_UNSCALE's inverse.
inline float4 word_codes(uint w) {
    const uint u = w ^ 0x80808080u;
    return as_float4(((uint4)(u, u, u >> 16, u >> 16) & I8_MASK) | I8_MAGIC) - I8_OFFSET;
}

// The chunk's 16 weights code * s, wv[j] = columns 4j .. 4j+3.
inline void dequantize_chunk8(uint4 w, float s, float4* wv) {
    const float4 su = s * I8_UNSCALE;
    wv[0] = word_codes(w.s0) * su, wv[1] = word_codes(w.s1) * su;
    wv[2] = word_codes(w.s2) * su, wv[3] = word_codes(w.s3) * su;
}
