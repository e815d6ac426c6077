"""The `int8-gemm` phase: ONNX Runtime's dynamic-quantized matmuls onto the int8 kernel.

TVM's importer turns `quantize_dynamic`'s DynamicQuantizeLinear + MatMulInteger (+ Cast,
Mul by the scales, Add of the bias) into

    a32 = astype(quantize(x, s_x, zp_x), int32) - astype(zp_x, int32)    # u8 activations
    w32 = W_const(int32) - astype(zp_w, int32)                            # s8 weights
    y = matmul(a32, w32, out_dtype=int32)                                 # an int32 GEMM loop
    z = astype(y, float32) * (s_x * s_w) [+ bias]

This pass replaces y (and the cast/scale/bias and a relu/gelu after it, when each step has
that one user)
with one call of compile/quant/gemm.kernel on the u8 activations and the prepacked s8
weights; the zero points fold into the kernel's column-sum term and, for a weight zero point
other than 0, a row-sum correction computed beside it. Activations whose signedness is not
the instruction's are shifted (s8 -> u8 by +128 for VNNI, u8 -> s8 by -128 for SDOT) and the
shift is folded into the zero point. In a module this rewrites, the whole-
tensor max(x) and min(x) pairs (DynamicQuantizeLinear's range) go to compile/quant/minmax's
parallel kernel instead of two serial scalar loops.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from blockforge.compile.passes.exprs import rewrite_functions
from blockforge.compile.passes.kernels import add_kernel
from blockforge.compile.quant import gemm, minmax, sums
from blockforge.compile.quant.isa import ISAS

_log = logging.getLogger("blockforge.quant")


def _call(e, *names):
    op = getattr(e, "op", None)
    return getattr(op, "name", None) in names


def _dtype(e) -> str | None:
    d = getattr(getattr(e, "ty", None), "dtype", None)
    return str(d) if d is not None else None


def _shape(e) -> list | None:
    s = getattr(getattr(e, "ty", None), "shape", None)
    return list(s) if s is not None else None


def _same_shape(a, b) -> bool:
    """Shapes as the same dims (structurally: symbolic dims are PrimExprs, whose == builds an
    expression rather than comparing)."""
    from blockforge.compile.attention.match import same_dim

    sa, sb = _shape(a), _shape(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(same_dim(x, y) for x, y in zip(sa, sb))


def _static(d) -> int | None:
    from tvm import tirx

    return int(d.value) if isinstance(d, tirx.IntImm) else None


def _rows(shape) -> tuple:
    """A GEMM operand's rows, every dim but the last multiplied: (the expression, its int where
    static, else None)."""
    m = 1
    for d in shape[:-1]:
        m = m * d
    return m, (m if isinstance(m, int) else _static(m))


def _same(a, b) -> bool:
    return a is not None and b is not None and a.same_as(b)


def _shifted_dtype(shift: int) -> str:
    """What 8-bit values are after a signedness shift: +128 makes s8 u8, -128 u8 s8."""
    return "uint8" if shift > 0 else "int8"


def _resigned(bb, x, shift: int):
    """8-bit values moved by `shift` into the other signedness (s8 -> u8: +128; u8 -> s8: -128),
    exactly."""
    from tvm import relax

    return bb.emit(relax.op.astype(relax.op.add(relax.op.astype(x, "int32"), relax.const(shift, "int32")),
                                   _shifted_dtype(shift)))


@dataclass
class _Match:
    out: object  # the var whose binding the kernel call replaces
    act: object  # u8/s8 activations (..., K)
    zp_a: object | None  # their zero point (a scalar tensor), None = 0
    w: np.ndarray  # (K, N) int8 values
    zp_w: int  # the weights' (per-tensor) zero point after choosing an int8 form
    scale: object | None  # (), (N,) float32, or None (int32 result)
    bias: object | None
    out_shape: list  # [..., n]: n the model's columns, spec.n that rounded up to 16 (padded)
    spec: gemm.Int8GemmSpec
    # the kernel's last quantize writes the next int8 GEMM's activations already shifted to its
    # instruction's signedness (zero point + shift); `out` then keeps the model's dtype beside them
    shift_out: int = 0
    # a runtime B (a QDQ attention product: K^T, V): the int8 (K, N) tensor packed and summed in
    # the graph each call (`w` is then None, `zp_w` its zero point as stored, s8)
    w_var: object | None = None
    # the activations' producer where it is a per-tensor QuantizeLinear with constant parameters
    # (x, scale, zero point, dtype): their shift to the instruction's signedness is then that
    # quantize with its zero point moved (exact), not a pass over the 8-bit tensor
    act_q: tuple | None = None
    # the ("add",) step's tensor (an attention mask, a residual): the kernel reads it as (M, N)
    addend: object | None = None


def _addend(b, out, batched: bool) -> bool:
    """`b` can be the kernel's (M, N) addend for the GEMM output `out` (its value's type):
    float32 and, unbatched (a weights GEMM: M is every row of the output), the output's shape;
    batched (a batched-heads product, (1, h, S, N)), the last two dims the output's and every
    one before them 1 (Hugging Face's (1, 1, S, S) mask: the same for every head). A per-head
    addend is left as a separate add."""
    from blockforge.compile.attention.match import same_dim

    sb, so = _shape(b), _shape(out)
    if _dtype(b) != "float32" or sb is None or so is None:
        return False
    if not batched:
        return _same_shape(b, out)
    return 2 <= len(sb) <= len(so) and all(_static(d) == 1 for d in sb[:-2]) \
        and all(same_dim(x, y) for x, y in zip(sb[-2:], so[-2:]))


def _shift_outputs(matches: list, shift_for) -> None:
    """A GEMM whose post chain ends in a quantize that feeds another int8 GEMM writes that
    GEMM's activations (s8 -> u8 +128 for VPDPBUSD) itself: clip(round(x/s) + zp + 128, 0, 255)
    is clip(round(x/s) + zp, -128, 127) + 128, so the separate shift pass over the tensor goes."""
    import dataclasses

    feeds = {mt.act: mt for mt in matches}  # (vars hash by identity)
    for mt in matches:
        last = mt.spec.post[-1] if mt.spec.post else None
        if last is None or last[0] != "q" or mt.out not in feeds:
            continue
        shift = shift_for(last[3])
        if shift:
            dtype = _shifted_dtype(shift)
            mt.spec = dataclasses.replace(mt.spec, post=mt.spec.post[:-1] + (("q", last[1], last[2] + shift, dtype),))
            mt.shift_out = shift


@dataclass
class _Range:
    """max(x) and min(x) over the whole tensor (DynamicQuantizeLinear's range): one kernel."""
    x: object
    max_var: object
    min_var: object
    spec: minmax.MinMaxSpec
    emitted: object = None  # the kernel's (max, min) tuple, once emitted


def _whole_reduction(value, op: str):
    if not _call(value, op) or _dtype(value) != "float32" or value.attrs.axis is not None:
        return None
    return value.args[0]


class _Finder:
    def __init__(self, func, isa: str = "vnni", post: bool = True, products: bool = True, batched: bool = True,
                 addends: bool = True, gelu_ops: bool = True):
        from tvm import relax

        from blockforge.compile.attention.heads import graph

        self.isa, self.post, self.products, self.batched, self.addends = isa, post, products, batched, addends
        self.gelu_ops = gelu_ops
        self.values, self.users = graph(func)  # var -> value; var -> the binding vars that read it
        self.dataflow = relax.DataflowVar

    def isa_for(self, k: int, n: int, w: np.ndarray | None = None) -> str | None:
        """The instruction a (K, N) GEMM runs on: the pass's, or its fallback where K is not
        whole k-groups of it (SMMLA's 8 -> SDOT's 4) or, for an instruction that saturates
        (VPMADDUBSW), where the weights `w` could saturate it or are known only at run time
        (None): VPMADDWD on int16; None: neither takes it."""
        for isa in (self.isa, ISAS[self.isa].fallback):
            if isa is None or not gemm.supported(k, n, isa):
                continue
            if ISAS[isa].pair_bound is not None and (w is None or not ISAS[isa].exact_for(w)):
                continue
            return isa
        return None

    def value(self, e):
        from tvm import relax

        while isinstance(e, relax.Var) and e in self.values:
            e = self.values[e]
        return e

    def const(self, e) -> np.ndarray | None:
        """The value of a constant expression the importer leaves (const, astype, subtract)."""
        import tvm

        e = self.value(e)
        if isinstance(e, tvm.ir.expr.GenericConst):
            return e.value.numpy()
        if _call(e, "relax.astype"):
            v = self.const(e.args[0])
            return None if v is None else v.astype(str(e.attrs.dtype))
        if _call(e, "relax.subtract"):
            a, b = self.const(e.args[0]), self.const(e.args[1])
            return None if a is None or b is None else (a.astype(np.int64) - b.astype(np.int64))
        return None

    def only_user(self, var):
        """The binding var that is var's one user (var local to the dataflow block), else None."""
        users = self.users.get(var, [])
        return users[0] if isinstance(var, self.dataflow) and len(users) == 1 else None

    def activations(self, e):
        """(a8, zp_a or None) from astype(a8, int32) [- zp_a], a8 u8 or s8."""
        v = self.value(e)
        zp = None
        if _call(v, "relax.subtract"):
            if _shape(v.args[1]) not in ([],) or _dtype(v.args[1]) != "int32":
                return None
            v, zp = self.value(v.args[0]), v.args[1]
        if not _call(v, "relax.astype") or _dtype(v.args[0]) not in ("uint8", "int8"):
            return None
        return v.args[0], zp

    def weights(self, e) -> tuple[np.ndarray, int] | None:
        """(int8 W, zp_w) with W_effective = W - zp_w, zp_w one scalar; None if no such form."""
        w = self.const(e)
        if w is None or w.ndim != 2 or not np.issubdtype(w.dtype, np.integer):
            return None
        return gemm.int8_weights(w)

    def ranges(self) -> list[_Range]:
        out = []
        maxes = [(v, x) for v, val in self.values.items() if (x := _whole_reduction(val, "relax.max")) is not None]
        for v, val in self.values.items():
            x = _whole_reduction(val, "relax.min")
            mx = next((m for m, mxx in maxes if x is not None and mxx.same_as(x)), None)
            shape = _shape(x) if x is not None else None
            if mx is None or shape is None or len(shape) < 2 or not minmax.supported(_static(shape[-1])):
                continue
            out.append(_Range(x, mx, v, minmax.MinMaxSpec(cols=_static(shape[-1]), rows=_rows(shape)[1])))
        return out

    def qparams(self, value) -> tuple[float, int, str] | None:
        """(scale, zero point, int dtype) of a per-tensor relax.quantize/dequantize with constant
        parameters, else None."""
        if len(value.args) != 3:
            return None
        s, zp = self.const(value.args[1]), self.const(value.args[2])
        if s is None or zp is None or s.size != 1 or zp.size != 1 or s.dtype != np.float32:
            return None
        dtype = str(value.attrs.out_dtype) if _call(value, "relax.quantize") else _dtype(value.args[0])
        scale = float(s.reshape(()))
        # (the model is untrusted: a scale the kernel's spec refuses leaves the step as written)
        if dtype not in ("int8", "uint8") or str(zp.dtype) != dtype or not (math.isfinite(scale) and scale > 0):
            return None
        return scale, int(zp.reshape(())), dtype

    def feeds_product(self, dq) -> bool:
        """The dequantized tensor is an operand of an attention product the int8 kernel takes
        (match_dequantized): the chain before it then ends in its quantize ("q"), whose 8-bit
        tensor the product reads. (Taken as "qdq", the product read the quantize the chain had
        absorbed: a one-head MHA's q and v projections fell back to TVM's int32 matmul loops.)"""
        user = self.only_user(dq)
        uv = self.values.get(user)
        return self.products and uv is not None and _call(uv, "relax.matmul") and _dtype(uv) == "float32" \
            and len(uv.args) == 2 and self.match_dequantized(user, uv) is not None

    def post_chain(self, out, n: int, batched: bool = False, addend_ok: bool = True):
        """(out, steps, bias, addend) of what follows the scaled GEMM in a QDQ model:
        QuantizeLinear/DequantizeLinear pairs, the bias add between them, gelu/relu, an add of a
        tensor of the output's rows (_addend), and a last QuantizeLinear (the next GEMM's int8
        input), each step the previous one's only user; gemm.POST_STEPS."""
        steps, bias, addend = [], None, None
        while True:
            gelu = self.erf_gelu(out) if self.gelu_ops else None
            if gelu is not None and _same_shape(self.values[gelu], self.values[out]):
                out = gelu
                steps.append(("gelu",))
                continue
            user = self.only_user(out)
            uv = self.values.get(user)
            if uv is None or not _same_shape(uv, self.values[out]):
                break
            if _call(uv, "relax.quantize") and uv.args[0].same_as(out) and (qp := self.qparams(uv)) is not None:
                dq = self.only_user(user)
                dv = self.values.get(dq)
                if dv is not None and _call(dv, "relax.dequantize") and _dtype(dv) == "float32" \
                        and self.qparams(dv) == qp and not self.feeds_product(dq):
                    out = dq
                    steps.append(("qdq", *qp))
                    continue
                out = user
                steps.append(("q", *qp))
                break
            kind = {"relax.nn.relu": "relu", "relax.nn.gelu": "gelu"}.get(getattr(getattr(uv, "op", None), "name", None))
            if kind is not None:
                out = user
                steps.append((kind,))
                continue
            if _call(uv, "relax.add"):
                b = uv.args[1] if uv.args[0].same_as(out) else uv.args[0]
                if bias is None and _dtype(b) == "float32" and [_static(d) for d in (_shape(b) or [])] == [n]:
                    out, bias = user, b
                    steps.append(("bias",))
                    continue
                if addend is None and addend_ok and self.addends and _addend(b, self.values[out], batched):
                    out, addend = user, b
                    steps.append(("add",))
                    continue
            break
        return out, tuple(steps), bias, addend

    def erf_gelu(self, x):
        """The var that ends gelu spelled out on `x`, x * 0.5 * (1 + erf(x / sqrt(2))) in the
        orders exporters write it (Hugging Face BERT: Div, Erf, Add, Mul, Mul; the 0.5 first or
        last, x / sqrt(2) as a Div or as a Mul by 1 / sqrt(2)), each op the one user of the one
        before; else None. (fast_math takes it later as elementwise ops: in a QDQ model, a kernel
        of its own between the GEMM and the quantize, 0.4 ms a layer at seq 512.)"""
        from blockforge.compile.passes.exprs import const_scalar

        def op(v, name):
            val = self.values.get(v)
            return val if val is not None and _call(val, name) else None

        def with_const(val, c: float, rel: float = 1e-4):  # the operand that is not ~c, else None
            for mine, other in ((0, 1), (1, 0)):
                k = const_scalar(val.args[other])
                if k is not None and abs(k - c) <= rel * abs(c):
                    return val.args[mine]
            return None

        users = self.users.get(x, [])
        if not isinstance(x, self.dataflow) or len(users) != 2:
            return None
        for scaled in users:
            d = op(scaled, "relax.divide")
            if not (d is not None and d.args[0].same_as(x) and (k := const_scalar(d.args[1])) is not None
                    and abs(k - math.sqrt(2)) <= 1e-4 * math.sqrt(2)):
                d = op(scaled, "relax.multiply")
                if d is None or with_const(d, 1 / math.sqrt(2)) is None or not any(a.same_as(x) for a in d.args):
                    continue
            e = self.only_user(scaled)
            if e is None or op(e, "relax.erf") is None:
                continue
            a = self.only_user(e)
            av = op(a, "relax.add") if a is not None else None
            if av is None or with_const(av, 1.0) is None:
                continue
            other = next(u for u in users if not u.same_as(scaled))
            m = self.only_user(a)
            mv = op(m, "relax.multiply") if m is not None else None
            ov = op(other, "relax.multiply")
            if mv is None or ov is None:
                continue
            if other.same_as(m):  # x * (1 + erf), then * 0.5
                last = self.only_user(m)
                lv = op(last, "relax.multiply") if last is not None else None
                if lv is not None and with_const(lv, 0.5) is not None:
                    return last
            elif with_const(mv, 0.5) is not None:  # 0.5 * (1 + erf), then x * that (HF BERT)
                if _same(self.only_user(m), other) and any(v.same_as(m) for v in ov.args):
                    return other
            elif with_const(ov, 0.5) is not None and _same(self.only_user(other), m):
                return m  # (x * 0.5) * (1 + erf)
        return None

    def quantized(self, e):
        """(x, scale, zero point, dtype) of a per-tensor QuantizeLinear with constant parameters
        that `e` is bound to, else None."""
        return self._per_tensor(e, "relax.quantize")

    def dequantized(self, e):
        """(q, scale, zero point, dtype) of a per-tensor DequantizeLinear with constant parameters
        that `e` is bound to, else None."""
        return self._per_tensor(e, "relax.dequantize")

    def _per_tensor(self, e, op: str):
        """(its input, scale, zero point, dtype) of a float32 <-> 8-bit `op` call `e` is bound to."""
        v = self.value(e)
        if not _call(v, op) or _dtype(v.args[0] if op == "relax.quantize" else v) != "float32":
            return None
        qp = self.qparams(v)
        return None if qp is None else (v.args[0], *qp)

    def match_dequantized(self, var, value) -> _Match | None:
        """MatMul(DQ(a), DQ(b)) of two runtime 8-bit tensors, per-tensor parameters: a QDQ model's
        attention products (Q K^T, P V), which TVM imports as dequantize + float32 GEMM. On the
        int8 kernel with b packed at run time (its K x N bytes: 32 KiB a head at BERT's 64 x 512);
        static K % 4, N % 16 and a batch of one, else left as written."""
        a, b = self.dequantized(value.args[0]), self.dequantized(value.args[1])
        if a is None or b is None or self.const(b[0]) is not None:
            return None
        ashape, bshape = _shape(a[0]), [_static(d) for d in (_shape(b[0]) or [])]
        if ashape is None or len(ashape) != len(bshape) or len(bshape) < 2 or None in bshape:
            return None
        # the leading dims (a batched-heads export's (1, h)): static, the same on both operands
        if [_static(d) for d in ashape[:-2]] != bshape[:-2]:
            return None
        batch = int(np.prod(bshape[:-2], dtype=np.int64))
        if batch > 1 and not self.batched:
            return None  # (int8_gemm's batched_products: the int8-batched-products ablation)
        k, n = bshape[-2:]
        isa = self.isa_for(k, n)
        if _static(ashape[-1]) != k or isa is None:
            return None
        rows = _static(ashape[-2])
        if rows is not None and batch * rows * k * n < gemm.PARALLEL_MACS:
            # one thread (gemm.PARALLEL_MACS) plus the packing: BERT-base's QDQ MHA at seq 128
            # (12 heads of 128x64x128, one call each) measured 1.13x the float32 products
            return None
        (_, sa, za, _), (_, sb, zb, bdtype) = a, b
        zp_w = zb - 128 if bdtype == "uint8" else zb  # stored s8 (b - 128) for the signed operand
        out, post, bias, addend = self.post_chain(var, n, batch > 1) if self.post else (var, (), None, None)
        spec = gemm.Int8GemmSpec(k=k, n=n, m=rows, scale="scalar", bias=bias is not None, rowcorr=zp_w != 0,
                                 isa=isa, post=post, batch=batch)
        from tvm import relax

        # one float scale, as the weight QDQ rewrite (compile/quant/qdq.py) makes s_x * s_w
        scale = relax.const(np.float32(sa) * np.float32(sb), "float32")
        return _Match(out, a[0], relax.const(za, "int32"), None, zp_w, scale, bias, [*ashape[:-1], n], spec,
                      w_var=b[0], act_q=self.quantized(a[0]), addend=addend)

    def match(self, var, value) -> _Match | None:
        if _call(value, "relax.matmul") and _dtype(value) == "float32" and len(value.args) == 2:
            return self.match_dequantized(var, value) if self.products else None
        if not _call(value, "relax.matmul") or _dtype(value) != "int32" or len(value.args) != 2:
            return None
        act = self.activations(value.args[0])
        wz = self.weights(value.args[1])
        if act is None or wz is None:
            return None
        shape = _shape(value.args[0])
        k, n = wz[0].shape
        isa = self.isa_for(k, gemm.padded(n), wz[0])
        if shape is None or len(shape) < 2 or _static(shape[-1]) != k or isa is None:
            return None
        _, m_static = _rows(shape)
        out, scale, bias, scale_kind = var, None, None, "none"
        cast = self.only_user(var)
        if cast is not None and _call(self.values[cast], "relax.astype") and _dtype(self.values[cast]) == "float32":
            mul = self.only_user(cast)
            mv = self.values.get(mul)
            if mv is not None and _call(mv, "relax.multiply") and _dtype(mv) == "float32":
                other = mv.args[1] if mv.args[0].same_as(cast) else mv.args[0]
                oshape = _shape(other)
                kind = None if oshape is None else {(): "scalar", (n,): "column"}.get(tuple(_static(d) for d in oshape))
                if kind is not None and _same_shape(mv, self.values[cast]):
                    out, scale, scale_kind = mul, other, kind
                    add = self.only_user(mul)
                    av = self.values.get(add)
                    if av is not None and _call(av, "relax.add") and _same_shape(av, mv):
                        b = av.args[1] if av.args[0].same_as(mul) else av.args[0]
                        if _dtype(b) == "float32" and [_static(d) for d in (_shape(b) or [])] == [n]:
                            out, bias = add, b
        activation = "none"
        if scale is not None:
            user = self.only_user(out)
            uv = self.values.get(user)
            kind = {"relax.nn.relu": "relu", "relax.nn.gelu": "gelu"}.get(getattr(getattr(uv, "op", None), "name", None))
            if kind is not None and _same_shape(uv, self.values[out]):
                out, activation = user, kind
        post, addend = (), None
        if self.post and scale is not None and bias is None and activation == "none":
            # (a ragged N computes padded columns, cropped after the kernel: no addend of N)
            out, post, bias, addend = self.post_chain(out, n, addend_ok=gemm.padded(n) == n)
        spec = gemm.Int8GemmSpec(k=k, n=gemm.padded(n), m=m_static, scale=scale_kind, bias=bias is not None,
                                 rowcorr=wz[1] != 0, activation=activation, isa=isa, post=post)
        return _Match(out, act[0], act[1], wz[0], wz[1], scale, bias, [*shape[:-1], n], spec, addend=addend)


def int8_gemm(isa: str = "vnni", target=None, database=None, post: bool = True, stack: bool = True,
              epilogue: gemm.Epilogue | None = None, products: bool = True, sums_kernels: bool = True,
              shift_quantize: bool = True, batched_products: bool = True, addends: bool = True,
              gelu_ops: bool = True):
    """The `int8-gemm` pass for a CPU target with the dot-product instruction `isa`
    (compile/quant/isa.py: "vnni" for AVX-512 VNNI, "sdot" for aarch64 +dotprod); a kernel's
    tiles come from the tuning database where it has a record for its spec
    (compile/quant/tiles.py), else the defaults; post False: no QDQ chain in the epilogue
    (the int8-qdq-epilogue ablation); stack False: untuned kernels on the 6 x 4 tile
    (gemm.LEGACY_TILE, the int8-stack-tiles ablation); epilogue: how the kernels compute
    their post steps (None: gemm.epilogue_for(target), the table where the target has
    AVX512_VBMI and the reciprocal quantize; the pipeline's int8-lut-tail and
    reciprocal ablations turn them off); products False: a QDQ model's attention
    products stay dequantize + float32 (the int8-attention ablation); sums_kernels False: the
    zero-point row and column sums by TVM's reductions (int8-sums); shift_quantize False: an
    activation's s8 <-> u8 shift as a pass, not its quantize's (int8-shift-quantize); addends
    False: an add of a tensor of the output's rows (an attention mask, a residual) stays a pass
    of its own (int8-addend); gelu_ops False: gelu spelled out in ops (Div, Erf, Add, Mul, Mul)
    stays out of the post chain (int8-gelu-ops).

    batched_products: a batched-heads export's products ((1, h, S, d) x (1, h, d, S): Hugging Face
    SDPA exports) as one batched int8 kernel each (False: they stay dequantize + float32, the
    int8-batched-products ablation). HF BERT-base QDQ, the whole model, interleaved: 0.933 / 0.919
    at seq 512, 0.960 / 0.968 at 128 (each build twice). It needed the nan-guard rewrite first
    (compile/passes/nan_guard.py): before it, the softmax writing 8-bit P ran 3.8-4.0 ms a layer
    where the float32 one ran 1.46, and the products measured 1.048 / 1.005 (no gain).
    """
    import tvm

    shift_for = ISAS[isa].shift
    epilogue = epilogue if epilogue is not None else gemm.epilogue_for(target)
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Rewrite(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.plan: dict = {}
            self.shifted: dict = {}  # a GEMM's out var -> (its activations for the next GEMM, shift)
            self.funcs: dict = {}
            self.applied: list[str] = []

        def kernel_gv(self, spec):
            if spec not in self.funcs:
                from blockforge.compile.quant.tiles import tile_record

                tiles = tile_record(database, spec, target) if target is not None else None
                if tiles is not None:
                    _log.info("int8 gemm %s: tuned tiles %s", spec.describe(), tiles.describe())
                elif not stack:
                    tiles = gemm.default_tiles(spec, stack=False)
                self.funcs[spec] = add_kernel(self.builder_, gemm.kernel(spec, tiles, epilogue),
                                               f"int8_gemm_{len(self.funcs)}")
            return self.funcs[spec]

        def emit_call(self, mt: _Match):
            bb, sp = self.builder_, mt.spec
            pre = self.shifted.get(mt.act)  # the GEMM before wrote these activations shifted
            act = pre[0] if pre is not None else self.visit_expr(mt.act)
            shift = shift_for(_dtype(act))
            if shift and pre is None and mt.act_q is not None and shift_quantize:
                # quantize(x, s, zp) + c is quantize(x, s, zp + c) into the other signedness (the
                # identity _shift_outputs uses): the quantize writes the instruction's bytes itself.
                # A P of 12 x 512 x 512 bytes (HF BERT-base QDQ at seq 512) took 0.85 ms a layer to
                # shift as a pass.
                x, s, zq, _ = mt.act_q
                to = _shifted_dtype(shift)
                act = bb.emit(relax.op.quantize(self.visit_expr(x), relax.const(s, "float32"),
                                                relax.const(zq + shift, to), out_dtype=to))
                pre, shift = (act, shift), 0
            lead = [sp.batch] if sp.batch > 1 else []  # (batch, M, K): a batched kernel's rows per GEMM
            m = _shape(act)[-2] if lead else _rows(_shape(act))[0]
            a2 = bb.emit(relax.op.reshape(act, relax.ShapeExpr([*lead, m, sp.k])))
            zp = self.visit_expr(mt.zp_a) if mt.zp_a is not None else relax.const(0, "int32")
            if pre is not None:
                zp = bb.emit(relax.op.add(zp, relax.const(pre[1], "int32")))
            if shift:
                # (a + c) - (zp + c) = a - zp: s8 -> u8 for VPDPBUSD (c = 128), u8 -> s8 for SDOT
                # (c = -128); the column-sum term then takes the shifted zero point.
                a2 = _resigned(bb, a2, shift)
                zp = bb.emit(relax.op.add(zp, relax.const(shift, "int32")))
            isa = ISAS[sp.isa]
            # VPMADDWD's operands are int16: the 8-bit activations widened (fused into their
            # quantize); the row sums below still read the 8-bit ones
            a_in = bb.emit(relax.op.astype(a2, isa.act_dtype)) if isa.act_dtype == "int16" else a2
            if mt.w_var is not None:
                n, pad = sp.n, 0
                args = [a_in, *self.runtime_weights(mt.w_var, sp.k, sp.n, isa, lead), zp]
            else:
                n = mt.w.shape[1]
                pad = sp.n - n  # a ragged N (GPT-2's lm_head: 50257): zero columns, cropped below
                w = np.pad(mt.w, ((0, 0), (0, pad))) if pad else mt.w
                args = [a_in, relax.const(gemm.pack_weights(w.astype(isa.w_dtype), isa.kgroup)),
                        relax.const(gemm.column_sums(w)), zp]
            if sp.rowcorr:
                # -zp_w rowsum(A) + K zp_a zp_w, per row (exact in int32 for K*255*255 < 2^31).
                rs = self.row_sums(a2, lead, m, sp.k)
                kz = bb.emit(relax.op.multiply(zp, relax.const(sp.k, "int32")))
                args.append(bb.emit(relax.op.multiply(relax.op.subtract(kz, rs), relax.const(mt.zp_w, "int32"))))
            for x, fill in ((mt.scale, 1.0), (mt.bias, 0.0)):
                if x is not None:
                    x = self.visit_expr(x)
                    if pad and _shape(x):  # a per-column scale or the bias, to the padded N
                        x = bb.emit(relax.op.concat([x, relax.const(np.full(pad, fill, np.float32))], axis=0))
                    args.append(x)
            if mt.addend is not None:  # (M, N): the mask's leading 1s, a residual's rows flattened
                args.append(bb.emit(relax.op.reshape(self.visit_expr(mt.addend), relax.ShapeExpr([m, sp.n]))))
            y = bb.emit(relax.call_tir(self.kernel_gv(sp), args,
                                       out_ty=relax.TensorType([*lead, m, sp.n], sp.out_dtype)))
            if pad:
                y = bb.emit(relax.op.strided_slice(y, axes=[1], begin=[0], end=[n]))
            self.applied.append(sp.describe())
            if mt.shift_out:
                # the next GEMM reads the shifted tensor; the model's own (unshifted) one is left
                # for any other reader (and dropped as unused when there is none)
                u = bb.emit(relax.op.reshape(y, relax.ShapeExpr(mt.out_shape)))
                self.shifted[mt.out] = (u, mt.shift_out)
                return relax.op.astype(relax.op.subtract(relax.op.astype(u, "int32"),
                                                         relax.const(mt.shift_out, "int32")), _dtype(mt.out))
            return relax.op.reshape(y, relax.ShapeExpr(mt.out_shape))

        def runtime_weights(self, b, k: int, n: int, isa, lead: list):
            """A runtime (K, N) 8-bit operand as the kernel reads weights: packed (N/16, K/g, 16,
            g) as gemm.pack_weights packs constants (g the ISA's kgroup; int16 on VPMADDWD), and
            its column sums; u8 stored as s8 (b - 128, the zero point moved alike at match time);
            `lead` [batch]: one such per GEMM."""
            bb = self.builder_
            g = isa.kgroup
            b = bb.emit(relax.op.reshape(self.visit_expr(b), relax.ShapeExpr([*lead, k, n])))
            if _dtype(b) == "uint8":
                b = _resigned(bb, b, -128)
            wide = relax.op.astype(b, isa.w_dtype) if isa.w_dtype != "int8" else b
            groups = relax.op.reshape(wide, relax.ShapeExpr([*lead, k // g, g, n // 16, 16]))
            o = len(lead)
            packed = bb.emit(relax.op.permute_dims(groups, [*range(o), o + 2, o, o + 3, o + 1]))
            if not sums_kernels:
                return packed, bb.emit(relax.op.sum(relax.op.astype(b, "int32"), axis=[-2]))
            spec = sums.SumSpec("cols", k, "int8", batch=lead[0] if lead else 1, n=n)
            colsum = bb.emit(relax.call_tir(self.sum_kernel(spec), [bb.emit(relax.op.reshape(b, [spec.batch, k, n]))],
                                            out_ty=relax.TensorType([spec.batch, n], "int32")))
            return packed, bb.emit(relax.op.reshape(colsum, [*lead, n]))

        def sum_kernel(self, spec: sums.SumSpec):
            if spec not in self.funcs:
                self.funcs[spec] = add_kernel(self.builder_, sums.kernel(spec), f"int8_sums_{len(self.funcs)}")
            return self.funcs[spec]

        def row_sums(self, a2, lead: list, m, k: int):
            """The int32 row sums of the GEMM's 8-bit activations (lead + (m, k)): (lead + (m,))."""
            bb = self.builder_
            if not sums.rows_supported(k) or not sums_kernels:  # (K % 16: TVM's own reduction)
                return bb.emit(relax.op.sum(relax.op.astype(a2, "int32"), axis=[-1]))
            rows = m * lead[0] if lead else m
            spec = sums.SumSpec("rows", k, _dtype(a2), rows=rows if isinstance(rows, int) else _static(rows))
            flat = bb.emit(relax.op.reshape(a2, [rows, k]))
            rs = bb.emit(relax.call_tir(self.sum_kernel(spec), [flat], out_ty=relax.TensorType([rows], "int32")))
            return bb.emit(relax.op.reshape(rs, [*lead, m])) if lead else rs

        def emit_range(self, r: _Range, var):
            bb = self.builder_
            if r.emitted is None:
                x = self.visit_expr(r.x)
                rows = 1
                for d in _shape(x)[:-1]:
                    rows = rows * d
                x2 = bb.emit(relax.op.reshape(x, relax.ShapeExpr([rows, r.spec.cols])))
                if r.spec not in self.funcs:
                    self.funcs[r.spec] = add_kernel(bb, minmax.kernel(r.spec), f"int8_range_{len(self.funcs)}")
                scalar = relax.TensorType([], "float32")
                r.emitted = bb.emit(relax.call_tir(self.funcs[r.spec], [x2], out_ty=[scalar, scalar]))
            return relax.TupleGetItem(r.emitted, 0 if var.same_as(r.max_var) else 1)

        def visit_var_binding_(self, binding):
            mt = self.plan.get(binding.var)
            if mt is None:
                return super().visit_var_binding_(binding)
            value = self.emit_range(mt, binding.var) if isinstance(mt, _Range) else self.emit_call(mt)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeInt8Gemm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        def plan(m, func) -> bool:
            f = _Finder(func, isa, post, products, batched_products, addends, gelu_ops)
            matches = [mt for v, val in f.values.items() if (mt := f.match(v, val)) is not None]
            if not matches:
                return False
            _shift_outputs(matches, shift_for)
            m.plan = {mt.out: mt for mt in matches}
            # The activations' range for their dynamic quantization, next to the int8 GEMMs.
            for r in f.ranges():
                m.plan[r.max_var] = m.plan[r.min_var] = r
            return True

        m = _Rewrite(mod)
        out = rewrite_functions(mod, m, plan, unused=True)
        for line in m.applied:
            _log.info("int8 gemm: %s", line)
        return out

    return _pass
