"""Integer dot products of weight codes with int16 activations, written as LLVM vector IR (numba cannot say it).

numba types the product of two int32 values as int64, so a loop of ``int8 * int16`` products sums in 64-bit
lanes and LLVM cannot turn it into the 16-bit multiply-adds CPUs have (x86's vpmaddwd, vpdpwssd with VNNI, ARM's
smlal); and a numba loop over groups sums each group horizontally before scaling it. These intrinsics multiply
widened codes and activations and add neighbouring products, which LLVM lowers to those instructions on any
target: ``scaled_rows_dot`` for a row-major int8 row (the scaled sums kept in a float vector across the row),
``int4_pairs_dot`` for a block of int4 rows laid out with the rows across the vector, ``int5_rows_dot`` for a
row of an int5 weight in GGML's 5-bit split, ``int6_rows_dot`` for a row of GGUF Q6_K.

numba's on-disk cache of the kernels that use these is keyed on kernels.py alone: after editing an intrinsic here
(and not kernels.py), delete perfx_numba_cpu/__pycache__/*.nbi and *.nbc, or the old code keeps running.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _arrays(context, builder, signature, args) -> list:
    """The intrinsic's array arguments as numba array structs (``.data``, ``.shape``), in order; scalars skipped."""
    return [
        context.make_array(t)(context, builder, a)
        for t, a in zip(signature.args, args, strict=True)
        if isinstance(t, types.Array)
    ]


def scaled_rows_dot(lanes: int, tile: int):
    """An intrinsic ``(q, scales, f16, xq, xs, j0, out, r)``: out[j0 + j, r] = sum over groups g of
    (q[g] . xq[j0 + j, g]) * scale[g] * xs[j0 + j, g] for j < ``tile`` and j0 + j < len(out), groups of ``lanes``
    columns.

    q: one row of int8 codes; scales: its float16 bits viewed as int16 (looked up in ``f16``, the float32 value of
    each bit pattern, as kernels.f16_table) or float32, one per group; xq (n, k) int16 and xs (n, groups) float32:
    rows of x and their scales per group, at least j0 + tile of them; out (n, m) float32. All C-contiguous.

    One loop in IR so that each row's sum stays a float vector across groups: a group's codes are widened and its
    scale looked up once for the tile; per row of x, a multiply of widened codes and activations, an add of
    neighbouring products (vpmaddwd), a conversion and a vector multiply-add; a horizontal sum per row at the end.
    """

    @intrinsic
    def scaled_dot(typingctx, q, scales, f16, xq, xs, j0, out, r):
        ok = all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (q, scales, f16))
        ok = ok and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (xq, xs, out))
        if not ok or q.dtype != types.int8 or xq.dtype != types.int16 or xs.dtype != types.float32:
            return None
        if scales.dtype not in (types.int16, types.float32) or f16.dtype != types.float32:
            return None
        if out.dtype != types.float32:
            return None
        sig = types.void(q, scales, f16, xq, xs, types.intp, out, types.intp)

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            half_lanes = lanes // 2
            wide = ir.VectorType(i32, lanes)
            sums = ir.VectorType(f32, half_lanes)
            arrays = _arrays(context, builder, signature, args)
            q_data, s_data, table, x_data, xs_data, out_data = (a.data for a in arrays)
            groups = builder.extract_value(arrays[1].shape, 0)
            k = builder.extract_value(arrays[3].shape, 1)
            x_rows = [builder.add(args[5], ir.Constant(intp, j)) for j in range(tile)]
            even = ir.Constant(ir.VectorType(i32, half_lanes), list(range(0, lanes, 2)))
            odd = ir.Constant(ir.VectorType(i32, half_lanes), list(range(1, lanes, 2)))
            splat = ir.Constant(ir.VectorType(i32, half_lanes), [0] * half_lanes)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(sums, [0.0] * half_lanes)) for _ in range(tile)]
            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                start = builder.mul(g, ir.Constant(g.type, lanes))
                codes = builder.load(
                    builder.bitcast(builder.gep(q_data, [start]), ir.VectorType(ir.IntType(8), lanes).as_pointer()),
                    align=1,
                )
                codes = builder.sext(codes, wide)
                scale = builder.load(builder.gep(s_data, [g]))
                if signature.args[1].dtype == types.int16:  # float16 bits, read as uint16: a table index
                    scale = builder.load(builder.gep(table, [builder.zext(scale, ir.IntType(64))]))
                for j, row in enumerate(x_rows):
                    at = builder.add(builder.mul(row, k), start)
                    acts = builder.load(
                        builder.bitcast(builder.gep(x_data, [at]), ir.VectorType(ir.IntType(16), lanes).as_pointer()),
                        align=1,
                    )
                    product = builder.mul(codes, builder.sext(acts, wide))
                    pairs = builder.add(
                        builder.shuffle_vector(product, product, even), builder.shuffle_vector(product, product, odd)
                    )
                    x_scale = builder.load(builder.gep(xs_data, [builder.add(builder.mul(row, groups), g)]))
                    factor = builder.fmul(scale, x_scale)
                    lane0 = builder.insert_element(ir.Constant(sums, ir.Undefined), factor, ir.Constant(i32, 0))
                    factors = builder.shuffle_vector(lane0, lane0, splat)
                    step = builder.fmul(builder.sitofp(pairs, sums), factors, flags=["fast"])
                    builder.store(builder.fadd(builder.load(accs[j]), step, flags=["fast"]), accs[j])
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, sums]), f"llvm.vector.reduce.fadd.v{half_lanes}f32"
            )
            n_out = builder.extract_value(arrays[5].shape, 0)
            m_out = builder.extract_value(arrays[5].shape, 1)
            for j, row in enumerate(x_rows):
                total = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(accs[j])])
                total.fastmath.add("fast")  # an unordered sum: without it LLVM adds the lanes one by one
                with builder.if_then(builder.icmp_signed("<", row, n_out)):
                    builder.store(total, builder.gep(out_data, [builder.add(builder.mul(row, m_out), args[7])]))
            return context.get_dummy_value()

        return sig, codegen

    return scaled_dot


def _pair_sums(builder, codes, acts):
    """16 codes (int32 lanes) times 16 int16 activations with neighbouring products added: 8 int32 lanes, which LLVM
    lowers to vpmaddwd (the split formats' kernels)."""
    i32 = ir.IntType(32)
    product = builder.mul(codes, builder.sext(acts, codes.type))
    even = ir.Constant(ir.VectorType(i32, 8), list(range(0, 16, 2)))
    odd = ir.Constant(ir.VectorType(i32, 8), list(range(1, 16, 2)))
    return builder.add(builder.shuffle_vector(product, product, even), builder.shuffle_vector(product, product, odd))


def _interleaves():
    """The index vectors of vpunpcklbw (u = 0) and vpunpckhbw (u = 1) of 32-byte vectors a and b: per 128-bit half
    L, the pairs (a, b) of bytes 16L + 8u .. 16L + 8u + 7, i.e. int16 words of bytes 0-7 then 16-23 (u = 0) or 8-15
    then 24-31 (u = 1) of a, widened by b (zeros, or sign bytes)."""
    return [
        ir.Constant(
            ir.VectorType(ir.IntType(32), 32),
            [v for lane in (0, 1) for i in range(8) for v in (16 * lane + 8 * u + i, 32 + 16 * lane + 8 * u + i)],
        )
        for u in (0, 1)
    ]


def _halves_splat(builder, first, second):
    """An 8-lane float vector of ``first`` in lanes 0-3 and ``second`` in 4-7 (one factor per 128-bit half)."""
    f32, i32 = ir.FloatType(), ir.IntType(32)
    two = ir.Constant(ir.VectorType(f32, 2), ir.Undefined)
    for lane, value in enumerate((first, second)):
        two = builder.insert_element(two, value, ir.Constant(i32, lane))
    return builder.shuffle_vector(two, two, ir.Constant(ir.VectorType(i32, 8), [0, 0, 0, 0, 1, 1, 1, 1]))


def _store_row_sums(builder, accs, x_rows, out, column, fast: bool, extra=None) -> None:
    """out[row, column] = the sum of the 8 float lanes of accs[j] (plus the scalar extra[j]) for each x row j that
    lies inside out (a numba array struct): the split formats' kernels' last step."""
    f32 = ir.FloatType()
    lanes = ir.VectorType(f32, 8)
    reduce = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(f32, [f32, lanes]), "llvm.vector.reduce.fadd.v8f32"
    )
    n_out, m_out = (builder.extract_value(out.shape, i) for i in (0, 1))
    for j, row in enumerate(x_rows):
        total = builder.call(reduce, [ir.Constant(f32, 0.0), builder.load(accs[j])])
        if fast:
            total.fastmath.add("fast")
        if extra is not None:
            total = builder.fadd(total, builder.load(extra[j]))
        with builder.if_then(builder.icmp_signed("<", row, n_out)):
            builder.store(total, builder.gep(out.data, [builder.add(builder.mul(row, m_out), column)]))


def int5_rows_dot(tile: int):
    """An intrinsic ``(low, high, scales, biases, f16, xq, xs, sums, j0, out, r)``: out[j0 + j, r] = the dot of one
    row of an Int5Weight with rows j0 + j of x, for j < ``tile`` and j0 + j < len(out).

    low (k/2,) uint8 and high (groups,) uint32: the row's arrays (weights.Int5Weight); scales and biases (groups,)
    int16, float16 bits looked up in ``f16`` (kernels.f16_table); xq (n, k) int16, xs and sums (n, groups)
    float32: x rounded per group of 32 in the column order below, its scales and its sums (kernels.quantize_x_int5);
    out (n, m).

    Codes are built in registers once for the tile, two groups at a time, one in each 128-bit half: the 32 bytes'
    low then high nibbles, or'ed with 16 where their bit of the group's uint32 is set, widened to int16 by
    interleaving with zeros (vpunpcklbw / vpunpckhbw), which puts columns 0-7 of both groups in one vector, then
    8-15, 16-23, 24-31: x is stored in that order. Per row of x, as scaled_rows_dot: multiplies of codes and
    activations with neighbouring products added (vpmaddwd), the four sums added in integers, one conversion and
    one multiply-add into a float vector by the two groups' scales; the biases times the groups' sums of x go to
    a scalar. An odd last group goes alone, in natural order. Codes are at most 31 and x at most 32767 in
    magnitude: a vector lane sums eight products, under 2^23, no overflow. 2048 x 640, one row of x, one thread:
    one group at a time took 164 us, two at a time 103 (int8: 67)."""

    @intrinsic
    def int5_dot(typingctx, low, high, scales, biases, f16, xq, xs, sums, j0, out, r):
        rows_1d = (low, high, scales, biases, f16)
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in rows_1d):
            return None
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (xq, xs, sums, out)):
            return None
        if (low.dtype, high.dtype, scales.dtype, biases.dtype) != (types.uint8, types.uint32, types.int16, types.int16):
            return None
        if f16.dtype != types.float32 or xq.dtype != types.int16:
            return None
        if any(a.dtype != types.float32 for a in (xs, sums, out)):
            return None
        sig = types.void(low, high, scales, biases, f16, xq, xs, sums, types.intp, out, types.intp)

        def codegen(context, builder, signature, args):
            f32, i8, i16, i32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            arrays = _arrays(context, builder, signature, args)
            low_d, high_d, s_d, b_d, table, x_d, xs_d, sums_d = (a.data for a in arrays[:8])
            groups = builder.extract_value(arrays[1].shape, 0)
            k = builder.extract_value(arrays[5].shape, 1)
            x_rows = [builder.add(args[8], ir.Constant(intp, j)) for j in range(tile)]
            bytes16, wide = ir.VectorType(i8, 16), ir.VectorType(i32, 16)
            sums_t = ir.VectorType(f32, 8)
            splat = ir.Constant(ir.VectorType(i32, 8), [0] * 8)
            nibble, shift = ir.Constant(bytes16, [15] * 16), ir.Constant(bytes16, [4] * 16)
            sixteen, zero = ir.Constant(bytes16, [16] * 16), ir.Constant(bytes16, [0] * 16)
            bit_of_lane = ir.Constant(bytes16, [1 << (i % 8) for i in range(16)])
            # Lane i of a half takes byte i // 8 (first half) or 2 + i // 8 (second) of the uint32 of fifth bits.
            spreads = [ir.Constant(ir.VectorType(i32, 16), [h * 2 + i // 8 for i in range(16)]) for h in (0, 1)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(sums_t, [0.0] * 8)) for _ in range(tile)]
            bias_accs = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(tile)]

            def half_value(data, g):
                return builder.load(builder.gep(table, [builder.zext(builder.load(builder.gep(data, [g])), i32)]))

            def one_group(g):
                at = builder.gep(low_d, [builder.mul(g, ir.Constant(g.type, 16))])
                bytes_ = builder.load(builder.bitcast(at, bytes16.as_pointer()), align=1)
                word = builder.bitcast(builder.load(builder.gep(high_d, [g])), ir.VectorType(i8, 4))
                halves = []  # columns 0..15 (low nibbles) and 16..31 (high nibbles), each with its fifth bits
                for h, nibbles in enumerate((builder.and_(bytes_, nibble), builder.lshr(bytes_, shift))):
                    spread = builder.shuffle_vector(word, word, spreads[h])
                    fifth = builder.icmp_unsigned("!=", builder.and_(spread, bit_of_lane), zero)
                    halves.append(builder.zext(builder.or_(nibbles, builder.select(fifth, sixteen, zero)), wide))
                scale, bias = half_value(s_d, g), half_value(b_d, g)
                start = builder.mul(g, ir.Constant(g.type, 32))
                for j, row in enumerate(x_rows):
                    x_at = builder.gep(x_d, [builder.add(builder.mul(row, k), start)])
                    x_pointer = builder.bitcast(x_at, ir.VectorType(i16, 16).as_pointer())
                    acts = [builder.load(builder.gep(x_pointer, [ir.Constant(i32, h)]), align=2) for h in (0, 1)]
                    # Both halves' pair sums added in integers (each under 2^21): one conversion and one
                    # multiply-add per group and row of x.
                    dots = builder.add(_pair_sums(builder, halves[0], acts[0]), _pair_sums(builder, halves[1], acts[1]))
                    group_at = builder.add(builder.mul(row, groups), g)
                    factor = builder.fmul(scale, builder.load(builder.gep(xs_d, [group_at])))
                    lane0 = builder.insert_element(ir.Constant(sums_t, ir.Undefined), factor, ir.Constant(i32, 0))
                    factors = builder.shuffle_vector(lane0, lane0, splat)
                    step = builder.fmul(builder.sitofp(dots, sums_t), factors, flags=["fast"])
                    builder.store(builder.fadd(builder.load(accs[j]), step, flags=["fast"]), accs[j])
                    biased = builder.fmul(bias, builder.load(builder.gep(sums_d, [group_at])))
                    builder.store(builder.fadd(builder.load(bias_accs[j]), biased), bias_accs[j])

            bytes32 = ir.VectorType(i8, 32)
            nibble32, shift32 = ir.Constant(bytes32, [15] * 32), ir.Constant(bytes32, [4] * 32)
            sixteen32, zero32 = ir.Constant(bytes32, [16] * 32), ir.Constant(bytes32, [0] * 32)
            bits32 = ir.Constant(bytes32, [1 << (i % 8) for i in range(32)])
            # Per 128-bit half L (group 2p + L), lane i takes byte 4L + i // 8 (low nibbles' bits) or 4L + 2 + i // 8.
            pair_spreads = [
                ir.Constant(ir.VectorType(i32, 32), [4 * (i // 16) + 2 * h + (i % 16) // 8 for i in range(32)])
                for h in (0, 1)
            ]
            unpacks = _interleaves()  # with zeros: words [group 2p's columns 8u..8u+7 | group 2p + 1's]

            def group_pair(p):
                """Groups 2p and 2p + 1 side by side, one in each 128-bit half, against x in pair order
                (kernels.quantize_x_int5): each instruction serves both groups."""
                g0 = builder.mul(p, ir.Constant(p.type, 2))
                g1 = builder.add(g0, ir.Constant(p.type, 1))
                at = builder.gep(low_d, [builder.mul(p, ir.Constant(p.type, 32))])
                bytes_ = builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)
                bits_at = builder.bitcast(builder.gep(high_d, [g0]), ir.VectorType(i8, 8).as_pointer())
                fifths = builder.load(bits_at, align=4)
                words = []  # four vectors of 16 codes as int16: quarter u of both groups
                for h, nibbles in enumerate(
                    (builder.and_(bytes_, nibble32), builder.and_(builder.lshr(bytes_, shift32), nibble32))
                ):
                    spread = builder.shuffle_vector(fifths, fifths, pair_spreads[h])
                    fifth = builder.icmp_unsigned("!=", builder.and_(spread, bits32), zero32)
                    codes = builder.or_(nibbles, builder.select(fifth, sixteen32, zero32))
                    for u in (0, 1):
                        interleaved = builder.shuffle_vector(codes, zero32, unpacks[u])
                        words.append(builder.sext(builder.bitcast(interleaved, ir.VectorType(i16, 16)), wide))
                scales = [half_value(s_d, g) for g in (g0, g1)]
                biases = [half_value(b_d, g) for g in (g0, g1)]
                start = builder.mul(p, ir.Constant(p.type, 64))
                for j, row in enumerate(x_rows):
                    x_at = builder.gep(x_d, [builder.add(builder.mul(row, k), start)])
                    x_pointer = builder.bitcast(x_at, ir.VectorType(i16, 16).as_pointer())
                    dots = None
                    for q in range(4):
                        acts = builder.load(builder.gep(x_pointer, [ir.Constant(i32, q)]), align=2)
                        part = _pair_sums(builder, words[q], acts)
                        dots = part if dots is None else builder.add(dots, part)
                    at0 = builder.add(builder.mul(row, groups), g0)
                    at1 = builder.add(at0, ir.Constant(at0.type, 1))
                    x_scales = [builder.load(builder.gep(xs_d, [at_g])) for at_g in (at0, at1)]
                    factors = _halves_splat(builder, *map(builder.fmul, scales, x_scales))
                    step = builder.fmul(builder.sitofp(dots, sums_t), factors, flags=["fast"])
                    builder.store(builder.fadd(builder.load(accs[j]), step, flags=["fast"]), accs[j])
                    for bias, at_g in zip(biases, (at0, at1), strict=True):
                        biased = builder.fmul(bias, builder.load(builder.gep(sums_d, [at_g])))
                        builder.store(builder.fadd(builder.load(bias_accs[j]), biased), bias_accs[j])

            pairs = builder.udiv(groups, ir.Constant(groups.type, 2))
            with cgutils.for_range(builder, pairs) as loop:
                group_pair(loop.index)
            with builder.if_then(builder.trunc(groups, ir.IntType(1))):  # an odd number of groups: the last one
                one_group(builder.sub(groups, ir.Constant(groups.type, 1)))
            # an unordered sum of the lanes (without it LLVM adds them one by one), then the biases' scalar
            _store_row_sums(builder, accs, x_rows, arrays[8], args[10], fast=True, extra=bias_accs)
            return context.get_dummy_value()

        return sig, codegen

    return int5_dot


def int6_rows_dot(tile: int):
    """An intrinsic ``(ql, qh, sub, d, f16, xq, xs, j0, out, r)``: out[j0 + j, r] = the dot of one row of an
    Int6Weight (GGUF Q6_K: ``(q - 32) * d * sub``) with rows j0 + j of x, for j < ``tile`` and j0 + j < len(out).

    ql (k/2,) and qh (k/4,) uint8, sub (k/16,) int8 and d (k/256,) int16 (float16 bits, looked up in ``f16``): the
    row's arrays (split_weights.Int6Weight); xq (n, k) int16 and xs (n, k/32) float32: x as
    kernels.quantize_x_int6 orders and scales it. Q6_K's layout makes each 32 columns' codes cheap: per 128 columns,
    32-byte loads of nibbles (columns 0-31 and 32-63 low, 64-95 and 96-127 high) and of bit pairs, which one
    uniform shift and mask puts in place for each 32. The codes, centred to -32..31, are widened with their signs
    by interleaving (columns 0-7 and 16-23 of the 32 in one vector, 8-15 and 24-31 in the other: x is stored in
    that order), so each vector lane sums products of one 16-column sub-scale. Codes are at most 32 and x 32767 in
    magnitude: a lane sums four products, under 2^23."""

    @intrinsic
    def int6_dot(typingctx, ql, qh, sub, d, f16, xq, xs, j0, out, r):
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (ql, qh, sub, d, f16)):
            return None
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (xq, xs, out)):
            return None
        if (ql.dtype, qh.dtype, sub.dtype, d.dtype) != (types.uint8, types.uint8, types.int8, types.int16):
            return None
        if f16.dtype != types.float32 or xq.dtype != types.int16 or xs.dtype != types.float32:
            return None
        if out.dtype != types.float32:
            return None
        sig = types.void(ql, qh, sub, d, f16, xq, xs, types.intp, out, types.intp)

        def codegen(context, builder, signature, args):
            f32, i8, i16, i32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            arrays = _arrays(context, builder, signature, args)
            ql_d, qh_d, sub_d, d_d, table, x_d, xs_d = (a.data for a in arrays[:7])
            groups = builder.extract_value(arrays[6].shape, 1)
            k = builder.extract_value(arrays[5].shape, 1)
            x_rows = [builder.add(args[7], ir.Constant(intp, j)) for j in range(tile)]
            bytes32, wide = ir.VectorType(i8, 32), ir.VectorType(i32, 16)
            sums_t = ir.VectorType(f32, 8)

            def splat(value):
                return ir.Constant(bytes32, [value] * 32)

            zero, centre = splat(0), splat(32)
            unpacks = _interleaves()  # with sign bytes
            accs = [cgutils.alloca_once_value(builder, ir.Constant(sums_t, [0.0] * 8)) for _ in range(tile)]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(sums_t, [sums_t] * 3), "llvm.fma.v8f32"
            )
            # d * sub is exact; the fence keeps fast-math around the kernel from regrouping d * sub * x's scale
            # differently in the row and the tile forms (a row's result would then depend on its batch).
            fence = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32]), "llvm.arithmetic.fence.f32"
            )

            def load32(data, at):
                return builder.load(builder.bitcast(builder.gep(data, [at]), bytes32.as_pointer()), align=1)

            def half(h):
                """Columns 128h .. 128h + 127: four groups of 32."""
                low_a = load32(ql_d, builder.mul(h, ir.Constant(h.type, 64)))
                low_b = load32(ql_d, builder.add(builder.mul(h, ir.Constant(h.type, 64)), ir.Constant(h.type, 32)))
                pairs = load32(qh_d, builder.mul(h, ir.Constant(h.type, 32)))
                nibbles = (
                    builder.and_(low_a, splat(15)),
                    builder.and_(low_b, splat(15)),
                    builder.lshr(low_a, splat(4)),
                    builder.lshr(low_b, splat(4)),
                )
                highs = (  # bit pair p of each byte, moved to bits 4-5
                    builder.shl(builder.and_(pairs, splat(3)), splat(4)),
                    builder.shl(builder.and_(pairs, splat(12)), splat(2)),
                    builder.and_(pairs, splat(48)),
                    builder.and_(builder.lshr(pairs, splat(2)), splat(48)),
                )
                d_at = builder.udiv(h, ir.Constant(h.type, 2))  # 256 columns per d
                d_value = builder.load(builder.gep(table, [builder.zext(builder.load(builder.gep(d_d, [d_at])), i32)]))
                for p in range(4):
                    g = builder.add(builder.mul(h, ir.Constant(h.type, 4)), ir.Constant(h.type, p))
                    codes = builder.sub(builder.or_(nibbles[p], highs[p]), centre)
                    signs = builder.select(builder.icmp_signed("<", codes, zero), splat(-1), zero)
                    words = [
                        builder.sext(
                            builder.bitcast(builder.shuffle_vector(codes, signs, unpacks[u]), ir.VectorType(i16, 16)),
                            wide,
                        )
                        for u in (0, 1)
                    ]
                    subs = []
                    for s_at in (
                        builder.mul(g, ir.Constant(g.type, 2)),
                        builder.add(builder.mul(g, ir.Constant(g.type, 2)), ir.Constant(g.type, 1)),
                    ):
                        scale = builder.fmul(d_value, builder.sitofp(builder.load(builder.gep(sub_d, [s_at])), f32))
                        subs.append(builder.call(fence, [scale]))
                    start = builder.mul(g, ir.Constant(g.type, 32))
                    for j, row in enumerate(x_rows):
                        x_at = builder.gep(x_d, [builder.add(builder.mul(row, k), start)])
                        x_pointer = builder.bitcast(x_at, ir.VectorType(i16, 16).as_pointer())
                        acts = [builder.load(builder.gep(x_pointer, [ir.Constant(i32, u)]), align=2) for u in (0, 1)]
                        dots = builder.add(
                            _pair_sums(builder, words[0], acts[0]), _pair_sums(builder, words[1], acts[1])
                        )
                        x_scale = builder.load(builder.gep(xs_d, [builder.add(builder.mul(row, groups), g)]))
                        factors = _halves_splat(builder, *(builder.fmul(sub, x_scale) for sub in subs))
                        # One explicit fma, no fast-math: a row of x gets the same bits alone and in a tile.
                        total = builder.call(fma, [builder.sitofp(dots, sums_t), factors, builder.load(accs[j])])
                        builder.store(total, accs[j])

            with cgutils.for_range(builder, builder.udiv(k, ir.Constant(k.type, 128))) as loop:
                half(loop.index)
            # in lane order (no fast-math): eight adds a row, the same whatever the tile
            _store_row_sums(builder, accs, x_rows, arrays[7], args[9], fast=False)
            return context.get_dummy_value()

        return sig, codegen

    return int6_dot


def int4_pairs_dot(tile: int, rows: int, chunk: int):
    """An intrinsic ``(codes_b, i0, i1, xq, j0, dots)``: the integer dot products of the ``rows`` rows of one
    block of kernels.int4_block_layout with ``tile`` rows of x (j0 ..), over the block's byte columns i0 .. i1.

    codes_b (k/2, rows) uint8: byte i of row t holds columns 2i (low nibble) and 2i + 1 (high nibble). xq (n, k/2)
    int32: x rounded to int16, the int16 of column 2i in the low half of element i (an int16 array of x viewed as
    int32). dots (tile, rows) int32 receives sum_i lo[i, t] * x[j, 2i] + hi[i, t] * x[j, 2i + 1].

    A byte column becomes a vector of (low, high) int16 pairs, one per row, once for the tile; each row of x is
    then one multiply-add of pairs per 16 rows (vpmaddwd, fused with the add where the CPU has VNNI). Codes are at
    most 15 and x at most 32767 in magnitude, so a group of 128 columns sums to under 2^26: no overflow.

    The block's rows go ``chunk`` at a time, one pass over the columns each, so that a tile's sums stay in vector
    registers: 64 rows by 4 rows of x are 32 AVX2 registers of sums, which LLVM spilled to the stack on every column.
    """
    assert rows % chunk == 0

    @intrinsic
    def pairs_dot(typingctx, codes_b, i0, i1, xq, j0, dots):
        arrays = (codes_b, xq, dots)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
            return None
        if codes_b.dtype != types.uint8 or xq.dtype != types.int32 or dots.dtype != types.int32:
            return None
        sig = types.void(codes_b, types.intp, types.intp, xq, types.intp, dots)

        def codegen(context, builder, signature, args):
            i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
            intp = context.get_value_type(types.intp)
            c_arr, x_arr, d_arr = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3, 5))
            start, stop, first_row = args[1], args[2], args[4]
            half = builder.extract_value(x_arr.shape, 1)
            pairs = ir.VectorType(i32, 2 * chunk)
            sums = ir.VectorType(i32, chunk)
            interleave = ir.Constant(ir.VectorType(i32, 2 * chunk), [v for t in range(chunk) for v in (t, chunk + t)])
            even = ir.Constant(ir.VectorType(i32, chunk), list(range(0, 2 * chunk, 2)))
            odd = ir.Constant(ir.VectorType(i32, chunk), list(range(1, 2 * chunk, 2)))
            splat = ir.Constant(ir.VectorType(i32, chunk), [0] * chunk)
            nibble = ir.Constant(ir.VectorType(i16, chunk), [15] * chunk)
            shift = ir.Constant(ir.VectorType(i16, chunk), [4] * chunk)
            x_rows = [builder.mul(builder.add(first_row, ir.Constant(intp, j)), half) for j in range(tile)]
            for c0 in range(0, rows, chunk):
                accs = [cgutils.alloca_once_value(builder, ir.Constant(sums, [0] * chunk)) for _ in range(tile)]
                with cgutils.for_range(builder, builder.sub(stop, start)) as loop:
                    i = builder.add(start, loop.index)
                    at = builder.add(builder.mul(i, ir.Constant(intp, rows)), ir.Constant(intp, c0))
                    column = builder.gep(c_arr.data, [at])
                    codes = builder.load(builder.bitcast(column, ir.VectorType(i8, chunk).as_pointer()), align=1)
                    codes = builder.zext(codes, ir.VectorType(i16, chunk))
                    low, high = builder.and_(codes, nibble), builder.lshr(codes, shift)
                    weights = builder.sext(builder.shuffle_vector(low, high, interleave), pairs)
                    for j in range(tile):
                        x_pair = builder.load(builder.gep(x_arr.data, [builder.add(x_rows[j], i)]))
                        lane0 = builder.insert_element(ir.Constant(sums, ir.Undefined), x_pair, ir.Constant(i32, 0))
                        x_pairs = builder.shuffle_vector(lane0, ir.Constant(sums, ir.Undefined), splat)
                        x_wide = builder.sext(builder.bitcast(x_pairs, ir.VectorType(i16, 2 * chunk)), pairs)
                        product = builder.mul(weights, x_wide)
                        added = builder.add(
                            builder.shuffle_vector(product, product, even),
                            builder.shuffle_vector(product, product, odd),
                        )
                        builder.store(builder.add(builder.load(accs[j]), added), accs[j])
                for j in range(tile):
                    target = builder.gep(d_arr.data, [ir.Constant(intp, j * rows + c0)])
                    builder.store(builder.load(accs[j]), builder.bitcast(target, sums.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return pairs_dot


def halves_to_floats(count: int):
    """An intrinsic ``(src, start, dst)``: dst[:count] = the float32 values of the float16 bit patterns
    src.flat[start:start + count] (src int16, C-contiguous; dst float32, 1-D, C-contiguous, at least count long).

    One vector conversion (x86's vcvtph2ps with F16C), exact for every pattern: prefill's dequantization and the
    embedding lookup widen a block's group of float16 scales or biases with it (the GEMV does the same in registers,
    scaled_accumulate); a lookup per lane in kernels.f16_table made a 64-row GEMV twice as slow."""

    @intrinsic
    def widen(typingctx, src, start, dst):
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in (src, dst)) or dst.ndim != 1:
            return None
        if src.dtype != types.int16 or dst.dtype != types.float32:
            return None
        sig = types.void(src, types.intp, dst)

        def codegen(context, builder, signature, args):
            s_arr = context.make_array(signature.args[0])(context, builder, args[0])
            d_arr = context.make_array(signature.args[2])(context, builder, args[2])
            at = builder.gep(s_arr.data, [args[1]])
            bits = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(16), count).as_pointer()), align=2)
            halves = builder.bitcast(bits, ir.VectorType(ir.HalfType(), count))
            floats = builder.fpext(halves, ir.VectorType(ir.FloatType(), count))
            builder.store(floats, builder.bitcast(d_arr.data, floats.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return widen


def floats_to_halves(count: int):
    """An intrinsic ``(src, dst)``: dst[:count] = the float16 bit patterns (int16) of src[:count] (float32), rounded to
    nearest even as NumPy's astype(float16) rounds (x86's vcvtps2ph with F16C): a float16 KV cache's new rows."""

    @intrinsic
    def narrow(typingctx, src, dst):
        if not all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == 1 for a in (src, dst)):
            return None
        if src.dtype != types.float32 or dst.dtype != types.int16:
            return None
        sig = types.void(src, dst)

        def codegen(context, builder, signature, args):
            s_arr = context.make_array(signature.args[0])(context, builder, args[0])
            d_arr = context.make_array(signature.args[1])(context, builder, args[1])
            floats = builder.load(
                builder.bitcast(s_arr.data, ir.VectorType(ir.FloatType(), count).as_pointer()), align=4
            )
            halves = builder.fptrunc(floats, ir.VectorType(ir.HalfType(), count))
            bits = builder.bitcast(halves, ir.VectorType(ir.IntType(16), count))
            builder.store(bits, builder.bitcast(d_arr.data, bits.type.as_pointer()), align=2)
            return context.get_dummy_value()

        return sig, codegen

    return narrow


def scaled_accumulate(rows: int, tile: int):
    """An intrinsic ``(scales_b, biases_b, supers_b, g, xs, sums, j0, dots, acc)``: for j < ``tile`` and t < ``rows``,
    acc[j, t] += scale[g, t] * xs[j0 + j, g] * dots[j, t] + bias[g, t] * sums[j0 + j, g], the int4 kernels' epilogue
    of a group for ``tile`` rows of x.

    scales_b (groups, rows) int16: float16 bits; biases_b (groups, rows) the same, or float32, or int8 of no groups
    (GGUF Q4_0: each bias is -8 times its scale, computed here, not stored); or both uint8, GGUF
    Q4_K's sc and m, with scale = d * sc and bias = -dmin * m for the float16 bits of d and dmin in supers_b
    (2 * groups / 8, rows) int16, rows 2s and 2s + 1 for groups 8s .. 8s + 7 (kernels.int4_block_layout); xs and
    sums (n, groups) float32; dots (tile, rows) int32; acc (tile, rows) float32; all C-contiguous. The float16
    values are widened in registers (vcvtph2ps with F16C) once for the tile: widening a group into a buffer first
    made SmolLM2's decode 5-10% slower than float32 scales did, in alternating runs on the VM. Every row of x gets
    the same instructions whatever the tile, in IEEE order, so a row's result does not depend on the batch it is in."""

    @intrinsic
    def accumulate(typingctx, scales_b, biases_b, supers_b, g, xs, sums, j0, dots, acc):
        arrays = (scales_b, biases_b, supers_b, xs, sums, dots, acc)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
            return None
        factored = scales_b.dtype == types.uint8 and biases_b.dtype == types.uint8
        plain = scales_b.dtype == types.int16 and biases_b.dtype in (types.int16, types.float32, types.int8)
        if not (factored or plain) or supers_b.dtype != types.int16:
            return None
        if xs.dtype != types.float32 or sums.dtype != types.float32:
            return None
        if dots.dtype != types.int32 or acc.dtype != types.float32:
            return None
        sig = types.void(scales_b, biases_b, supers_b, types.intp, xs, sums, types.intp, dots, acc)

        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            floats = ir.VectorType(f32, rows)
            s_arr, b_arr, u_arr, x_arr, sum_arr, d_arr, a_arr = _arrays(context, builder, signature, args)
            g, j0 = args[3], args[6]
            groups = builder.extract_value(x_arr.shape, 1)
            group_at = builder.mul(g, ir.Constant(g.type, rows))

            def load(data, at, element):
                pointer = builder.bitcast(builder.gep(data, [at]), ir.VectorType(element, rows).as_pointer())
                return builder.load(pointer, align=2)

            def halves(data, at):
                bits = builder.bitcast(load(data, at, ir.IntType(16)), ir.VectorType(ir.HalfType(), rows))
                return builder.fpext(bits, floats)

            def values(data, dtype):
                if dtype == types.int16:
                    return halves(data, group_at)
                if dtype == types.uint8:
                    return builder.uitofp(load(data, group_at, ir.IntType(8)), floats)
                return load(data, group_at, f32)

            def splat(value):
                lane0 = builder.insert_element(ir.Constant(floats, ir.Undefined), value, ir.Constant(i32, 0))
                zeros = ir.Constant(ir.VectorType(i32, rows), [0] * rows)
                return builder.shuffle_vector(lane0, ir.Constant(floats, ir.Undefined), zeros)

            scale = values(s_arr.data, signature.args[0].dtype)
            if signature.args[1].dtype == types.int8:  # Q4_0: -8 * scale, exact
                bias = builder.fmul(scale, ir.Constant(floats, [-8.0] * rows))
            else:
                bias = values(b_arr.data, signature.args[1].dtype)
            if factored:  # d * sc and -(dmin * m): exact in float32 (11-bit times 6-bit significands)
                per_super = builder.sdiv(
                    builder.mul(builder.extract_value(s_arr.shape, 0), ir.Constant(g.type, 2)),
                    builder.extract_value(u_arr.shape, 0),
                )
                d_at = builder.mul(
                    builder.mul(builder.sdiv(g, per_super), ir.Constant(g.type, 2)), ir.Constant(g.type, rows)
                )
                scale = builder.fmul(halves(u_arr.data, d_at), scale)
                dmin = halves(u_arr.data, builder.add(d_at, ir.Constant(g.type, rows)))
                bias = builder.fneg(builder.fmul(dmin, bias))
                # The fence keeps fast-math around the kernel from regrouping d * sc * x's scale differently in
                # the row and the tile forms (a row's result would then depend on its batch).
                fence = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(floats, [floats]), f"llvm.arithmetic.fence.v{rows}f32"
                )
                scale, bias = builder.call(fence, [scale]), builder.call(fence, [bias])
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(floats, [floats] * 3), f"llvm.fma.v{rows}f32"
            )
            for j in range(tile):
                row_at = ir.Constant(g.type, j * rows)
                x_at = builder.add(builder.mul(builder.add(j0, ir.Constant(j0.type, j)), groups), g)
                f = splat(builder.load(builder.gep(x_arr.data, [x_at])))
                xg = splat(builder.load(builder.gep(sum_arr.data, [x_at])))
                dots = builder.sitofp(load(d_arr.data, row_at, i32), floats)
                target = builder.bitcast(builder.gep(a_arr.data, [row_at]), floats.as_pointer())
                # One explicit fma and no fast-math: LLVM cannot contract or reorder these differently for the row
                # and the tile forms, so both give a row of x the same result to the bit.
                step = builder.call(fma, [builder.fmul(scale, f), dots, builder.fmul(bias, xg)])
                builder.store(builder.fadd(builder.load(target, align=4), step), target, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return accumulate
