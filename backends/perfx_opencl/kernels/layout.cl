// Weights re-packed on the device into the kernels' layouts (runtime.py prepare_weight): they are uploaded as
// the host holds them and transposed here, instead of by NumPy before the upload.
// transpose_rows: dst (cols, rows) = src (rows, cols) transposed, with elements of type ELEM (ushort: float16
// scales, uint: float32 biases or scales, uint4: 16-byte chunks of 32 int4 or 16 int8 codes; uchar, uint2: the
// int6 / int5 planes of int8_weight.cl). Global size (rows, cols): consecutive work-items write consecutive
// elements. dst starts dst_off elements into its buffer.
__kernel void transpose_rows(__global const ELEM* src, __global ELEM* dst, int dst_off, int rows, int cols) {
    const int r = get_global_id(0), c = get_global_id(1);
    dst[dst_off + (size_t)c * rows + r] = src[(size_t)r * cols + c];
}
