"""The rewrite pass (phase fuse-attention): each match becomes one call of the kernel."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

from blockforge.compile.attention.flash import AttentionSpec, KERNEL_ATTR, bf16_default, bf16_pairs, default_tiles, kernel
from blockforge.compile.attention.match import Heads, Match, find_attention, static_int, static_shape
from blockforge.compile.attention.tiles import tile_record
from blockforge.compile.passes.kernels import add_kernel


_log = logging.getLogger("blockforge.attention")


def _reshape(bb, x, shape):
    from tvm import relax

    return bb.emit(relax.op.reshape(x, relax.ShapeExpr(shape)))


class _Rewrite:
    """Emits the kernel calls; kernels of one spec and tiles are shared."""

    def __init__(self, bb, target, database, **options):
        """options: flash.kernel's (balance, key_tail, exp2, bf16, gqa_rows, short_tile)."""
        from blockforge.compile.schedule.base import vector_lanes

        self.bb, self.target, self.database = bb, target, database
        self.lanes = vector_lanes(target)
        self.options = dict(options, lanes=self.lanes)
        self.bf16 = self.options.get("bf16", False)
        self.funcs: dict = {}
        self.applied: list[str] = []
        # summed addends already emitted in the block being rewritten (a var of one dataflow
        # block cannot be read in another); MPNet's 12 layers add one (1, h, S, S) bias and one
        # mask: at seq 512 each sum reads and writes 12.6 MB
        self.sums: dict = {}

    def call(self, spec: AttentionSpec, args: list, out_shape: list):
        from tvm import relax

        bt = bf16_default(spec, self.lanes) if self.bf16 else None
        if bt is not None:
            # the bf16 kernel's own records (tune --precision bf16), not the float32 kernel's
            tiles = tile_record(self.database, spec, self.target, bf16=True) or bt
        else:
            tiles = tile_record(self.database, spec, self.target) or default_tiles(self.lanes)
        key = (spec, tiles)
        if key not in self.funcs:
            # one symbol per kernel: a model with several attention variants builds
            # the tiles and options: what rebuilt_kernel needs to make this kernel again for another
            # spec (the in-place cache)
            fn = kernel(spec, tiles, **self.options).with_attr(
                OPTIONS_ATTR, json.dumps({"tiles": list(tiles), **self.options}))
            self.funcs[key] = add_kernel(self.bb, fn, f"fused_attention_{len(self.funcs)}")
        bf16 = " bf16" if self.bf16 and bf16_pairs(spec, tiles[1], self.lanes) else ""
        self.applied.append(f"{spec.describe()} tiles={tiles[0]}x{tiles[1]}{bf16}")
        return relax.call_tir(self.funcs[key], args, out_ty=relax.TensorType(out_shape, spec.dtype))

    def single(self, m: Match, visit):
        from tvm import relax

        kt = self.bb.emit(relax.op.permute_dims(visit(m.k_src), [0, 1, 3, 2])) if m.k_src is not None else visit(m.kt)
        q = visit(m.q)
        if m.head_scale is not None:  # Q's rows of head h times its scale: the kernel's scores then are
            h = len(m.head_scale)
            shape = {"bhsd": (1, h, 1, 1), "bshd": (1, 1, h, 1)}[m.spec.q]
            q = self.bb.emit(relax.op.multiply(q, relax.const(m.head_scale.reshape(shape).astype(m.spec.dtype))))
        args = [q, kt, visit(m.v)]
        args += [self.mask(x, visit) for x in (m.add, m.keep) if x is not None]
        return self.call(m.spec, args, m.out_shape)

    def mask(self, x, visit):
        """A mask argument; the scores' addends (a tuple: a bias and a mask) summed into one."""
        from tvm import relax

        if not isinstance(x, tuple):
            return visit(x)
        parts = tuple(visit(a) for a in x)
        key = tuple(p.__hash__() for p in parts)  # TVM objects hash by identity
        if key not in self.sums:  # every layer adds the same bias and mask: summed once per block
            out = parts[0]
            for a in parts[1:]:
                out = self.bb.emit(relax.op.add(out, a))
            self.sums[key] = out
        return self.sums[key]

    def heads(self, g: Heads, visit):
        from tvm import relax

        bb, sp = self.bb, g.first.spec
        xq, xk, xv = visit(g.xq), visit(g.xk), visit(g.xv)
        (b, sq, _), skv = static_shape(xq), static_shape(xk)[1]
        h = static_int(static_shape(xq)[-1]) // sp.d
        q = _reshape(bb, xq, [b, sq, h, sp.d])  # (B, S, h, d_k)
        kt = bb.emit(relax.op.permute_dims(_reshape(bb, xk, [b, skv, h, sp.d]), [0, 2, 3, 1]))  # (B, h, d_k, S_kv)
        v = _reshape(bb, xv, [b, skv, h, sp.dv])  # (B, S_kv, h, d_v)
        spec = replace(sp, q="bshd", k="bhds", v="bshd", o="bshd", heads=h)
        args = [q, kt, v] + [self.mask(x, visit) for x in (g.first.add, g.first.keep) if x is not None]
        o = bb.emit(self.call(spec, args, [b, sq, h, sp.dv]))  # (B, S, h, d_v)
        return relax.op.reshape(o, relax.ShapeExpr([b, sq, h * sp.dv]))  # (B, S, h*d_v)


OPTIONS_ATTR = KERNEL_ATTR + ".options"  # PrimFunc attr: kernel()'s arguments besides the spec (JSON)


def rebuilt_kernel(func, spec: AttentionSpec):
    """The fused kernel `func` (a PrimFunc this pass made) built again for `spec`, with the
    tiles and options it was built with (compile/decode/inplace.py: the capacity-cache form)."""
    o = json.loads(str(func.attrs[OPTIONS_ATTR]))
    return kernel(spec, tuple(o.pop("tiles")), **o).with_attr(OPTIONS_ATTR, str(func.attrs[OPTIONS_ATTR]))


def fuse_attention(target, database=None, balance: bool = True, key_rows: bool = True, key_tail: bool = True,
                   exp2: bool = True, bf16: bool = False, gqa_rows: bool = True, short_tile: bool = True):
    """The `fuse-attention` pass: attention subgraphs -> call_tir of the fused kernel.
    balance=False: query tiles as recorded or default (ablation `attention-qtile`);
    key_tail=False: whole last key tiles (ablation `attention-key-tail`);
    exp2=False: the softmax's exps by fast_exp, not fast_exp2 (ablation `attention-exp2`);
    bf16: Q K^T and P V on VDPBF16PS where flash.bf16_pairs allows (`--precision bf16`, a
    target with AVX512_BF16; ablation `bf16-attention`);
    key_rows: a one-query-row attention reads K untransposed (match.find_attention);
    gqa_rows=False: a grouped-query decode step one job per query head, not per kv head
    (ablation `attention-gqa-rows`, flash.group_rows);
    short_tile=False: an Sq below one query tile as its own tile (ablation `attention-short-tile`)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Fuse(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.plan: dict = {}
            self.rw = _Rewrite(self.builder_, target, database, balance=balance, key_tail=key_tail, exp2=exp2,
                               bf16=bf16, gqa_rows=gqa_rows, short_tile=short_tile)

        def visit_binding_block_(self, block):
            self.rw.sums.clear()
            return super().visit_binding_block_(block)

        def visit_dataflow_block_(self, block):
            self.rw.sums.clear()
            return super().visit_dataflow_block_(block)

        def visit_var_binding_(self, binding):
            todo = self.plan.get(binding.var)
            if todo is None:
                return super().visit_var_binding_(binding)
            value = todo(self.visit_expr)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeFuseAttention")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        def plan(m, func) -> bool:
            singles, groups = find_attention(func, key_rows=key_rows)
            m.plan = {s.out: (lambda visit, s=s: m.rw.single(s, visit)) for s in singles}
            m.plan.update({g.out: (lambda visit, g=g: m.rw.heads(g, visit)) for g in groups})
            return bool(m.plan)

        m = _Fuse(mod)
        out = rewrite_functions(mod, m, plan, unused=True)
        for line in m.rw.applied:
            _log.info("fused attention: %s", line)
        return out

    return _pass


def kernel_specs(mod) -> list[AttentionSpec]:
    """The specs of the fused attention kernels in a module (after the fuse-attention phase)."""
    from tvm import tirx

    out = []
    for _, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and KERNEL_ATTR in func.attrs:
            spec = AttentionSpec.from_json(str(func.attrs[KERNEL_ATTR]))
            if spec not in out:
                out.append(spec)
    return out
