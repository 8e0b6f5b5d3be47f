// The low nibbles and high bits of an int6 or int5 weight as the host holds them (perfx_core.split_weights: GGML's
// own order, rows of the file's blocks) into int8_weight.cl's lo and hi planes, chunk-major, on the device: the
// host uploads its arrays as they are. Each output is a (buffer, offset in uints) pair. Global size (rows, k / 16):
// one work-item per 16-column chunk of a row.

// lo: byte i of word 0 holds columns i (low nibble) and 4 + i, of word 1 columns 8 + i and 12 + i; nib[j] is the
// chunk's column j.
inline uint2 nibble_words(const uchar* nib) {
    uint2 words = (uint2)(0u);
    for (int i = 0; i < 4; ++i) {
        words.x |= (uint)(nib[i] | (nib[4 + i] << 4)) << (8 * i);
        words.y |= (uint)(nib[8 + i] | (nib[12 + i] << 4)) << (8 * i);
    }
    return words;
}

// int6 (GGUF Q6_K): per 128 columns, ql's 64 bytes (byte j: column j low nibble, j + 64 high) and qh's 32 (byte j:
// columns j, j + 32, j + 64, j + 96 in bit pairs 0-1 .. 6-7). hi: bits 2p, 2p + 1 of byte i are column 4p + i's.
__kernel void int6_to_chunks(__global const uchar* ql, __global const uchar* qh, __global uint* lo, int lo_off,
                             __global uint* hi, int hi_off, int rows, int chunks) {
    const int r = get_global_id(0), c = get_global_id(1);
    const size_t nibbles_at = (size_t)r * chunks * 8 + (c >> 3) * 64;
    const size_t crumbs_at = (size_t)r * chunks * 4 + (c >> 3) * 32;
    uchar nib[16], crumb[16];
    for (int i = 0; i < 16; ++i) {
        const int j = (c & 7) * 16 + i;  // the column within its 128
        nib[i] = (ql[nibbles_at + (j & 63)] >> (4 * (j >> 6))) & 0x0F;
        crumb[i] = (qh[crumbs_at + (j & 31)] >> (2 * (j >> 5))) & 0x03;
    }
    const size_t at = (size_t)c * rows + r;
    vstore2(nibble_words(nib), 0, lo + lo_off + 2 * at);
    uint word = 0;
    for (int i = 0; i < 4; ++i)
        word |= (uint)(crumb[i] | (crumb[4 + i] << 2) | (crumb[8 + i] << 4) | (crumb[12 + i] << 6)) << (8 * i);
    hi[hi_off + at] = word;
}

// int5 (GGUF Q5_0 / Q5_1 / Q5_K): per 32 columns, 16 bytes of low nibbles (byte j: column j low, j + 16 high) and a
// uint32 of fifth bits (bit j: column j). hi, one word per 32 columns (written by the group's first chunk): bit
// 8i + 4h + j is the fifth bit of column 16h + 4j + i.
__kernel void int5_to_chunks(__global const uchar* low, __global const uint* high, __global uint* lo, int lo_off,
                             __global uint* hi, int hi_off, int rows, int chunks) {
    const int r = get_global_id(0), c = get_global_id(1), h = c & 1;
    const size_t group = (size_t)r * (chunks >> 1) + (c >> 1);
    uchar nib[16];
    for (int i = 0; i < 16; ++i) nib[i] = (low[group * 16 + i] >> (4 * h)) & 0x0F;
    vstore2(nibble_words(nib), 0, lo + lo_off + 2 * ((size_t)c * rows + r));
    if (h == 0) {
        const uint bits = high[group];
        uint word = 0;
        for (int b = 0; b < 32; ++b) {
            const int i = b >> 3, h2 = (b >> 2) & 1, j = b & 3;
            word |= ((bits >> (16 * h2 + 4 * j + i)) & 1u) << b;
        }
        hi[hi_off + (size_t)(c >> 1) * rows + r] = word;
    }
}
