// Byte-decoded weights: the forms whose codes the int8 kernels (int8.cl, int8_gemm.cl, int8_mma.cl) read as one
// byte per column (the code plus a fixed offset, CODE_OFFSET), 16 columns (a chunk) at a time. Put before those
// files (kernel_source.py FILE_PRELUDES).
// One form per build:
//   int8 (default; perfx_core.weights.Int8Weight: GGUF Q8_0): W[r, c] = code[r, c] * scale[r, c / g].
//   -DINT6 (perfx_core.split_weights.Int6Weight: GGUF Q6_K): W = (code - 32) * d * sub, codes 0..63, an int8 sub per
//          16 columns (one chunk) and a float16 d per 256: the file's 0.8203 bytes per weight.
//   -DINT5 (Int5Weight: GGUF Q5_0, Q5_1, Q5_K): W = code * scale + bias per 32 columns, codes 0..31, scale and bias
//          float16; with -DQ5_0_BIAS every bias is -16 * scale (Q5_0) and none is stored or read (the file's 0.6875
//          bytes per weight; 0.75 with biases, Q5_1's size and 1.09x Q5_K's).
//
// Layout on the device (re-packed once at load, runtime.py), chunk-major like int4.cl's: element [c][r] of each
// per-chunk plane belongs to row r's columns 16c .. 16c+15, so a warp's loads are contiguous runs.
//   int8:  codes uint4 (k/16, m), byte i = column 16c + i; scale (k/g, m) float16 bits, or float32 with
//          -DSCALE_F32. g is 16, 32, 64 or 128, so a chunk never spans two groups.
//   int6:  lo uint2 (k/16, m): byte i of word 0 holds column i (low nibble) and 4 + i (high), of word 1 columns
//          8 + i and 12 + i; hi uint (k/16, m): bits 2p, 2p + 1 of byte i are the high bits of column 4p + i;
//          sub char (k/16, m); d (k/256, m) float16 bits.
//   int5:  lo as int6's; hi uint (k/32, m): bit 8i + 4h + j is the fifth bit of column 16h + 4j + i of the group
//          (h: which chunk of the group); scale and bias (k/32, m) float16 bits.
// Each layout is chosen so a word of 4 columns comes out of a few masks and shifts, no per-byte work.
// The arrays come as (buffer, element offset) pairs for int6 and int5 (a layer's weights share buffers, as the
// int4 ones do); an int8 weight has buffers of its own.

#ifdef SCALE_F32
#define SCALE_T float
#define LOAD_SCALE(g, scale) ((scale)[g])
#else
#define SCALE_T ushort
#define LOAD_SCALE(g, scale) vload_half((g), (__global const half*)(scale))
#endif

#if defined(INT6)
#define BYTE_WEIGHT_PARAMS                                                                                 \
    __global const uint *lo, int lo_off, __global const uint *hi, int hi_off, __global const char *sub, int sub_off, \
        __global const ushort *dd, int dd_off
#define BYTE_WEIGHT_AT lo += lo_off, hi += hi_off, sub += sub_off, dd += dd_off
#define BYTE_WEIGHT lo, hi, sub, dd
#define BYTE_WEIGHT_DECL \
    __global const uint *lo, __global const uint *hi, __global const char *sub, __global const ushort *dd
#elif defined(INT5)
#define BYTE_WEIGHT_PARAMS                                                                                 \
    __global const uint *lo, int lo_off, __global const uint *hi, int hi_off, __global const ushort *scale,   \
        int scale_off, __global const ushort *bias, int bias_off
#define BYTE_WEIGHT_AT lo += lo_off, hi += hi_off, scale += scale_off, bias += bias_off
#define BYTE_WEIGHT lo, hi, scale, bias
#define BYTE_WEIGHT_DECL \
    __global const uint *lo, __global const uint *hi, __global const ushort *scale, __global const ushort *bias
#else
#define BYTE_WEIGHT_PARAMS __global const uint *codes, __global const SCALE_T *scale
#define BYTE_WEIGHT_AT (void)0
#define BYTE_WEIGHT codes, scale
#define BYTE_WEIGHT_DECL BYTE_WEIGHT_PARAMS
#endif
#if defined(INT5) && !defined(Q5_0_BIAS)
#define HAS_BIAS 1  // the only form with a bias term: sum(x * (q*s + b)) = s * dot(q, x) + b * sum(x)
#endif

// Each form's bytes decode to code + CODE_OFFSET, 0..255: the int8 form's with its sign bit flipped (+128), int6's
// and Q5_0's as stored (their centres 32 and 16 are the offsets), a biased int5's as stored (offset 0: the bias term
// does the rest).
#if defined(INT6)
#define CODE_OFFSET 32
#elif defined(INT5) && defined(Q5_0_BIAS)
#define CODE_OFFSET 16
#elif defined(INT5)
#define CODE_OFFSET 0
#else
#define CODE_OFFSET 128
#endif

// Word t (columns 4t .. 4t+3) of row's chunk c as offset bytes (code + CODE_OFFSET).
inline uint chunk_word(BYTE_WEIGHT_DECL, size_t c, size_t row, size_t m, int t) {
#if defined(INT6) || defined(INT5)
    const uint l = (lo[(c * m + row) * 2 + (t >> 1)] >> (4 * (t & 1))) & 0x0F0F0F0Fu;
#if defined(INT6)
    return l | (((hi[c * m + row] >> (2 * t)) & 0x03030303u) << 4);
#else
    return l | (((hi[(c >> 1) * m + row] >> (4 * (c & 1) + t)) & 0x01010101u) << 4);
#endif
#else
    return codes[(c * m + row) * 4 + t] ^ 0x80808080u;
#endif
}

// The whole chunk: its 4 words as chunk_word gives them (one load per plane).
inline uint4 chunk_words(BYTE_WEIGHT_DECL, size_t c, size_t row, size_t m) {
#if defined(INT6) || defined(INT5)
    const uint2 l = vload2(c * m + row, lo);
    const uint4 nib = (uint4)(l.x, l.x >> 4, l.y, l.y >> 4) & 0x0F0F0F0Fu;
#if defined(INT6)
    const uint h = hi[c * m + row];
    return nib | ((uint4)(h << 4, h << 2, h, h >> 2) & 0x30303030u);
#else
    const uint h = hi[(c >> 1) * m + row] >> (4 * (c & 1));
    return nib | ((uint4)(h << 4, h << 3, h << 2, h << 1) & 0x10101010u);
#endif
#else
    return vload4(c * m + row, codes) ^ 0x80808080u;
#endif
}

// (scale, bias) of row's chunk c; group_shift is log2 of the int8 form's group size (the others' are fixed).
inline float2 chunk_factors(BYTE_WEIGHT_DECL, size_t c, size_t row, size_t m, int group_shift) {
#if defined(INT6)
    return (float2)(vload_half((c >> 4) * m + row, (__global const half*)dd) * (float)sub[c * m + row], 0.0f);
#elif defined(INT5)
    const size_t g = (c >> 1) * m + row;
    const float s = vload_half(g, (__global const half*)scale);
#ifdef HAS_BIAS
    return (float2)(s, vload_half(g, (__global const half*)bias));
#else
    return (float2)(s, 0.0f);
#endif
#else
    return (float2)(LOAD_SCALE(((c << 4) >> group_shift) * m + row, scale), 0.0f);
#endif
}

// Byte -> float without an int-to-float conversion (int4.cl's trick for nibbles): an offset byte u = code + OFFSET
// masked in place into 0x4B000000 is the float 2^23 + u * 256^p, and subtracting 2^23 + OFFSET * 256^p leaves
// code * 256^p exactly. Bytes 0 and 1 of a word are masked in place (p = 0, 1), bytes 2 and 3 after a 16-bit
// shift; the 256^-p goes into the final combination (exact: a power of two).
#define I8_MAGIC 0x4B000000u
#define I8_MASK ((uint4)(0xFFu, 0xFF00u, 0xFFu, 0xFF00u))
#define I8_OFFSET                                                                                           \
    ((float4)(8388608.0f + CODE_OFFSET, 8388608.0f + 256.0f * CODE_OFFSET, 8388608.0f + CODE_OFFSET,         \
              8388608.0f + 256.0f * CODE_OFFSET))
#define I8_UNSCALE ((float4)(1.0f, 0.00390625f, 1.0f, 0.00390625f))

// The 4 codes of a word of offset bytes (columns 4j .. 4j+3 for word j of a chunk), times I8_UNSCALE's inverse.
inline float4 word_codes(uint u) {
    return as_float4(((uint4)(u, u, u >> 16, u >> 16) & I8_MASK) | I8_MAGIC) - I8_OFFSET;
}

// The chunk's 16 weights code * s + b, wv[j] = columns 4j .. 4j+3.
inline void dequantize_chunk8(uint4 u, float2 f, float4* wv) {
    const float4 su = f.x * I8_UNSCALE;
    wv[0] = word_codes(u.s0) * su + f.y, wv[1] = word_codes(u.s1) * su + f.y;
    wv[2] = word_codes(u.s2) * su + f.y, wv[3] = word_codes(u.s3) * su + f.y;
}
