// q4_blocks_to_chunks: GGML Q4_0 / Q4_1 rows as a GGUF stores them (BLOCK_BYTES 18 / 20 per 32 weights: float16
// d, Q4_1's float16 min, 16 bytes where byte j holds code j low and code j + 16 high) into the int4 layout of
// kernels/int4.cl: packed [block][row] (16 bytes, byte k holding codes 2k and 2k + 1), scale [block][row]
// (float16 bits) and, for Q4_1, bias [block][row] (its float16 min as float32; Q4_0's bias, -8 d, is derived by
// the matmuls: int4_bias.cl). Each output is a (buffer, offset) pair, as INT4_WEIGHT_PARAMS takes it. Global size
// (rows, blocks).
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
