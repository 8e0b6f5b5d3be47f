// q4_blocks_to_chunks: GGML Q4_0 / Q4_1 rows as a GGUF stores them (BLOCK_BYTES 18 / 20 per 32 weights: float16
// d, Q4_1's float16 min, 16 bytes where byte j holds code j low and code j + 16 high) into the int4 layout of
// kernels/int4.cl: packed [block][row] (16 bytes, byte k holding codes 2k and 2k + 1), scale [block][row]
// (float16 bits) and, for Q4_1, bias [block][row] (its float16 min as float32; Q4_0's bias, -8 d, is derived by
// the matmuls: int4_group.cl). Each output is a (buffer, offset) pair, as INT4_WEIGHT_PARAMS takes it. Global size
// (rows, blocks). Built with -DBLOCK_BYTES and -DHAS_MIN.
#ifdef BLOCK_BYTES
__kernel void q4_blocks_to_chunks(__global const uchar* src, __global uchar* packed, int packed_off,
                                  __global ushort* scale, int scale_off, __global float* bias, int bias_off, int rows,
                                  int blocks) {
    packed += packed_off;
    scale += scale_off;
    bias += bias_off;
    const int r = get_global_id(0), b = get_global_id(1);
    __global const uchar* block = src + ((size_t)r * blocks + b) * BLOCK_BYTES;  // even: float16 loads are aligned
    const size_t at = (size_t)b * rows + r;
    scale[at] = (ushort)(block[0] | (block[1] << 8));
#if HAS_MIN
    bias[at] = vload_half(0, (__global const half*)(block + 2));
#endif
    __global const uchar* codes = block + BLOCK_BYTES - 16;
    __global uchar* out = packed + at * 16;
    for (int k = 0; k < 8; k++) {
        const uchar lo = codes[2 * k], hi = codes[2 * k + 1];
        out[k] = (lo & 0x0F) | ((hi & 0x0F) << 4);  // codes 2k, 2k + 1 of the block's first half
        out[k + 8] = (lo >> 4) | (hi & 0xF0);  // the same of its second half (codes 16 + 2k, 17 + 2k)
    }
}
#endif

// q4_k_blocks_to_chunks: GGML Q4_K rows (144 bytes per 256 weights: float16 d and dmin, 12 bytes of eight 6-bit
// scales and mins, 128 bytes of codes where the 32 bytes of each 64-weight piece hold its first 32 codes low and
// the next 32 high) into the same int4 layout with the block's own factors (int4_group.cl, Q4_K_FACTORS): per
// 32-weight group sc | m << 8, per 256 weights the float16 bits d | -dmin << 16. One group per work-item; the
// first of a block's eight also writes the block's d and -dmin. Global size (rows, groups).
__kernel void q4_k_blocks_to_chunks(__global const uchar* src, __global uchar* packed, int packed_off,
                                    __global ushort* scale, int scale_off, __global uint* supers, int supers_off,
                                    int rows, int groups) {
    packed += packed_off;
    scale += scale_off;
    supers += supers_off;
    const int r = get_global_id(0), g = get_global_id(1), j = g % 8;  // j: the group within its 256-block
    __global const uchar* block = src + ((size_t)r * (groups / 8) + g / 8) * 144;
    __global const uchar* q = block + 4;  // the packed 6-bit scales and mins
    const uint sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    const uint m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    const size_t at = (size_t)g * rows + r;
    scale[at] = (ushort)(sc | (m << 8));
    if (j == 0)
        supers[(size_t)(g / 8) * rows + r] =
            ((uint)block[0] | ((uint)block[1] << 8) | ((uint)block[2] << 16) | ((uint)block[3] << 24)) ^ 0x80000000u;
    __global const uchar* codes = block + 16 + (j / 2) * 32;  // this group's 64-weight piece
    const int shift = 4 * (j % 2);  // its first 32 codes are the low nibbles, the next 32 the high ones
    __global uchar* out = packed + at * 16;
    for (int k = 0; k < 16; k++)
        out[k] = ((codes[2 * k] >> shift) & 0x0F) | (((codes[2 * k + 1] >> shift) & 0x0F) << 4);
}
