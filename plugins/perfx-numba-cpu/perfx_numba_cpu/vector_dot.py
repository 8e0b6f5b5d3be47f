"""Integer dot products over a few dozen lanes, written as LLVM vector IR (numba cannot say them itself).

numba types the product of two int32 values as int64, so a loop of ``int8 * int16`` products sums in 64-bit
lanes and LLVM cannot turn it into the 16-bit multiply-adds CPUs have (x86's vpmaddwd, ARM's smlal). These
intrinsics load ``lanes`` codes and ``lanes`` int16 activations, multiply them widened to int32 and add the
products up, which LLVM lowers to those instructions on any target.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _dot(lanes: int):
    @intrinsic
    def dot(typingctx, a, a_start, b, b_start):
        """sum(int32(a[a_start + i]) * int32(b[b_start + i]) for i < lanes), a of 8-bit codes and b of at most
        16-bit values (so no sum can overflow int32), both contiguous 1-D arrays. No bounds check: the caller
        keeps each start + lanes within its array."""
        for arr, bits in ((a, (8,)), (b, (8, 16))):
            if not (
                isinstance(arr, types.Array)
                and arr.ndim == 1
                and arr.layout == "C"
                and isinstance(arr.dtype, types.Integer)
                and arr.dtype.bitwidth in bits
            ):
                return None
        sig = types.int32(a, a_start, b, b_start)

        def codegen(context, builder, signature, args):
            i32 = ir.VectorType(ir.IntType(32), lanes)
            product = None
            for arr_type, arr, start in ((signature.args[0], args[0], args[1]), (signature.args[2], args[2], args[3])):
                data = context.make_array(arr_type)(context, builder, arr).data
                vec = ir.VectorType(ir.IntType(arr_type.dtype.bitwidth), lanes)
                loaded = builder.load(builder.bitcast(builder.gep(data, [start]), vec.as_pointer()), align=1)
                widened = builder.sext(loaded, i32) if arr_type.dtype.signed else builder.zext(loaded, i32)
                product = widened if product is None else builder.mul(product, widened)
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.IntType(32), [i32]), f"llvm.vector.reduce.add.v{lanes}i32"
            )
            return builder.call(reduce, [product])

        return sig, codegen

    return dot


dot16 = _dot(16)
dot32 = _dot(32)
