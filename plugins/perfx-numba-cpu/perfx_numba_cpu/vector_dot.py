"""A row of int8 codes times int16 activations, group by group, written as LLVM vector IR (numba cannot say it).

numba types the product of two int32 values as int64, so a loop of ``int8 * int16`` products sums in 64-bit
lanes and LLVM cannot turn it into the 16-bit multiply-adds CPUs have (x86's vpmaddwd, ARM's smlal); and a
numba loop over groups sums each group horizontally before scaling it. This intrinsic multiplies widened codes
and activations, adds neighbouring products (which LLVM lowers to those instructions on any target) and keeps
the scaled sums in one float vector across the row.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _scaled_row_dot(lanes: int):
    @intrinsic
    def scaled_row_dot(typingctx, q, scales, f16, xq, xs):
        """sum over groups g of (q[g] . xq[g]) * scale[g] * xs[g], groups of ``lanes`` columns: q int8 codes,
        xq int16, xs float32, scales float16 bits viewed as int16 (looked up in ``f16``, the float32 value of each
        bit pattern, as kernels.f16_table) or float32, all contiguous 1-D arrays with one scale per group
        (len(scales) groups).

        One loop in IR so that the sum stays a float vector across groups: each group is a multiply of widened
        codes and activations, an add of neighbouring products (vpmaddwd), a conversion and a vector
        multiply-add; a single horizontal sum at the end."""
        ok = all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (q, scales, f16, xq, xs))
        if not ok or q.dtype != types.int8 or xq.dtype != types.int16 or xs.dtype != types.float32:
            return None
        if scales.dtype not in (types.int16, types.float32) or f16.dtype != types.float32:
            return None
        sig = types.float32(q, scales, f16, xq, xs)

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            i32 = ir.IntType(32)
            half_lanes = lanes // 2
            wide = ir.VectorType(i32, lanes)
            sums = ir.VectorType(f32, half_lanes)
            arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args, strict=True)]
            q_data, s_data, table, x_data, xs_data = (a.data for a in arrays)
            groups = builder.extract_value(arrays[1].shape, 0)
            even = ir.Constant(ir.VectorType(i32, half_lanes), list(range(0, lanes, 2)))
            odd = ir.Constant(ir.VectorType(i32, half_lanes), list(range(1, lanes, 2)))
            splat = ir.Constant(ir.VectorType(i32, half_lanes), [0] * half_lanes)
            acc = cgutils.alloca_once_value(builder, ir.Constant(sums, [0.0] * half_lanes))
            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                start = builder.mul(g, ir.Constant(g.type, lanes))
                codes = builder.load(
                    builder.bitcast(builder.gep(q_data, [start]), ir.VectorType(ir.IntType(8), lanes).as_pointer()),
                    align=1,
                )
                acts = builder.load(
                    builder.bitcast(builder.gep(x_data, [start]), ir.VectorType(ir.IntType(16), lanes).as_pointer()),
                    align=1,
                )
                product = builder.mul(builder.sext(codes, wide), builder.sext(acts, wide))
                pairs = builder.add(
                    builder.shuffle_vector(product, product, even), builder.shuffle_vector(product, product, odd)
                )
                scale = builder.load(builder.gep(s_data, [g]))
                if signature.args[1].dtype == types.int16:  # float16 bits, read as uint16: a table index
                    scale = builder.load(builder.gep(table, [builder.zext(scale, ir.IntType(64))]))
                factor = builder.fmul(scale, builder.load(builder.gep(xs_data, [g])))
                lane0 = builder.insert_element(ir.Constant(sums, ir.Undefined), factor, ir.Constant(i32, 0))
                factors = builder.shuffle_vector(lane0, lane0, splat)
                step = builder.fmul(builder.sitofp(pairs, sums), factors, flags=["fast"])
                builder.store(builder.fadd(builder.load(acc), step, flags=["fast"]), acc)
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, sums]), f"llvm.vector.reduce.fadd.v{half_lanes}f32"
            )
            total = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(acc)])
            total.fastmath.add("fast")  # an unordered sum: without it LLVM adds the lanes one by one
            return total

        return sig, codegen

    return scaled_row_dot


scaled_row_dot16 = _scaled_row_dot(16)
scaled_row_dot32 = _scaled_row_dot(32)
