"""A preallocated KV cache written in place: the third entry `decode_inplace` (issue #21).

The step entry (`decode`, entries.py) computes each present as Concat(past, new): every step
writes the whole cache again (12-13% of a GPT-2 small step at P = 512 on the Zen 5,
`benchmarks/decode_entries.py --cache-copy`). With `compile --kv-capacity C` a decoder also
gets `decode_inplace`: the step entry whose past inputs are capacity buffers of C rows on the
past axis, holding the cache in rows [0, P), plus a last input `past_len`, the shape (P,)
(a ShapeTuple: P is no longer any tensor's dim). Per layer and cache:

  - Concat(past, new) -> present becomes R.call_tir_inplace of `kv_write_rows`, which writes
    the S new rows at [P, P + S) of the buffer (asserting P + S <= C) and returns the buffer;
  - the fused attention that read the present reads the buffer itself: the kernel of the
    same spec and tiles with `kv_capacity` = C (compile/attention/flash.py), K and V of C
    rows of which the first P + S are read, P + S a scalar input;
  - the entry returns the buffers as its presents (no allocation, no copy per step).

Where another op reads a present (attention not fused: a matmul over the cache), it reads
a slice [0, P + S) of the buffer: a copy of the cache per step, as Concat made (the rewrite
is still correct, not faster; `inplace_report` says how many). A cache input read by
anything but its Concat refuses the rewrite (compile error naming it).

The manifest records it (untrusted, manifest.py checks it as 'step'):

    "inplace": {"function": "decode_inplace", "capacity": C, "dim": "<the past dim>"}

compile/decode/loop.py's `run --decode` copies the prompt's presents into C-row buffers once
and then runs every step through this entry (DecodeOptions.inplace; `--copy-cache`: the
copying loop, for A/B).

Measured (benchmarks/decode_inplace.py, full size, C = 1024, 2 TVM threads, interleaved rounds,
two runs at load 6.5-11 on this 2-core Zen 5: ratios only): the in-place loop's step / the
copying loop's, GPT-2 small 0.898x / 0.917x at P = 128 and 0.593x / 0.855x at P = 512;
Llama-style GQA 1.001x / 1.026x and 0.868x / 0.991x (within the noise).
"""

from __future__ import annotations

import numpy as np

from blockforge.errors import ArgumentError
from blockforge.graph.model_io import MAX_BOUND_DIM

INPLACE_ENTRY = "decode_inplace"
KEY = "inplace"
SHAPE_INPUT = "past_len"  # the entry's input after the model's: the ShapeTuple (P,)
CAP_ATTR = "blockforge.kv_capacity"  # on the entry until the kv-inplace phase rewrites it
PAIRS_ATTR = "blockforge.kv_pairs"  # "past_param:present_output:axis,..."
MAX_CAPACITY = MAX_BOUND_DIM


def capacity_array(a: np.ndarray, axis: int, capacity: int) -> np.ndarray:
    """A capacity buffer holding `a` in its first rows along `axis` (the rest zero)."""
    shape = list(a.shape)
    filled, shape[axis] = shape[axis], capacity
    buf = np.zeros(shape, a.dtype)
    buf[(slice(None),) * axis + (slice(0, filled),)] = a
    return buf


def filled_rows(buf: np.ndarray, axis: int, n: int) -> np.ndarray:
    """A capacity buffer's first `n` rows along `axis`: the present the copying step returns."""
    return np.ascontiguousarray(buf[(slice(None),) * axis + (slice(0, n),)])


def check_capacity(c, argument: str = "kv_capacity") -> int:
    if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CAPACITY:
        raise ArgumentError(f"{{{argument}}} must be an integer in [1, {MAX_CAPACITY}] (cache rows), got {c!r}",
                            argument)
    return c


def cache_indices(inputs: list[dict], outputs: list[dict], pairing: dict) -> list[tuple[int, int, int]]:
    """(past input index, present output index, axis) per recorded pair."""
    ins = [s["name"] for s in inputs]
    outs = [s["name"] for s in outputs]
    return [(ins.index(p["past"]), outs.index(p["present"]), p["axis"]) for p in pairing["pairs"]]


def add_inplace_entry(mod, dim: str, capacity: int, pairs: list[tuple[int, int, int]]):
    """`mod` with `decode_inplace`: main at `dim` = 1 plus the input `past_len`, marked for the
    kv-inplace phase (kv_inplace_pass), which gives it the capacity buffers after fuse-attention."""
    import tvm
    from tvm import relax
    from tvm.relax.utils import copy_with_new_vars

    f = copy_with_new_vars(mod["main"]).bind_symbolic_vars({dim: 1})
    past_vars = {f.params[i].ty.shape.values[axis] for i, _, axis in pairs}
    if len(past_vars) != 1 or not isinstance(next(iter(past_vars)), tvm.tirx.Var):
        raise ArgumentError(f"{{kv_capacity}}: the caches' past lengths are not one symbolic dim "
                            f"({sorted(map(str, past_vars))})", "kv_capacity")
    shape_in = relax.Var(SHAPE_INPUT, relax.ShapeType([next(iter(past_vars))]))
    f = relax.Function([*f.params, shape_in], f.body, f.ret_ty, f.is_pure, f.attrs, f.span)
    f = f.with_attr("global_symbol", INPLACE_ENTRY).with_attr(CAP_ATTR, capacity) \
        .with_attr(PAIRS_ATTR, ",".join(f"{i}:{o}:{a}" for i, o, a in pairs))
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    out[INPLACE_ENTRY] = f
    return out


def write_rows_kernel(cap_shape: list, rows_shape: list, axis: int, dtype: str):
    """cache[..., P + j, ...] = rows[..., j, ...] along `axis` for the rows' S positions; the
    cache is the call's in-place output (no output buffer). P + S > C is an error, not a
    write past the buffer. Shapes: ints, or None for a symbolic dim (cache and rows share it)."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    dims = [i64(c) if c is not None else tirx.Var(f"d{k}", "int64") for k, c in enumerate(cap_shape)]
    rdims = [i64(r) if r is not None else (tirx.Var("rows", "int64") if k == axis else dims[k])
             for k, r in enumerate(rows_shape)]
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("kv_write_rows")
            cache = T.arg("cache", T.buffer(dims, dtype))
            rows = T.arg("new_rows", T.buffer(rdims, dtype))
            past = T.arg("past", tirx.Var("past", "int64"))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            with T.Assert(past + rdims[axis] <= dims[axis], "the KV cache's capacity is exceeded (compile "
                          "--kv-capacity: rows past + new > capacity)"):
                def nest(k, idx):
                    if k == len(rdims):
                        at = list(idx)
                        at[axis] = at[axis] + past
                        T.buffer_store(cache, tirx.BufferLoad(rows, idx), at)
                        return
                    with (T.vectorized if k == len(rdims) - 1 and k != axis else T.serial)(i64(0), rdims[k]) as v:
                        nest(k + 1, [*idx, v])

                nest(0, [])
    return ib.get().with_attr("global_symbol", "kv_write_rows")


def kv_inplace_pass():
    """The kv-inplace phase (after fuse-attention): functions marked by add_inplace_entry get
    their capacity buffers, in-place row writes and capacity attention kernels (module doc)."""
    import tvm
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeKVInplace")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        todo = [gv for gv, f in mod.functions_items()
                if isinstance(f, relax.Function) and f.attrs is not None and CAP_ATTR in f.attrs]
        for gv in todo:
            mod = _rewrite(mod, gv)
        return mod

    return _pass


def _rewrite(mod, gv):
    import tvm
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from blockforge.compile.attention.flash import KERNEL_ATTR, AttentionSpec
    from blockforge.compile.attention.fuse import OPTIONS_ATTR, rebuilt_kernel
    from blockforge.compile.passes.kernels import add_kernel
    from blockforge.errors import BlockforgeError

    func = mod[gv]
    cap = int(func.attrs[CAP_ATTR])
    pairs = [tuple(int(x) for x in p.split(":")) for p in str(func.attrs[PAIRS_ATTR]).split(",")]
    params = list(func.params)
    pvar = params[-1].ty.values[0]
    new_params = list(params)
    caps = {}  # old past param -> (capacity buffer param, axis)
    for i, _, axis in pairs:
        old = params[i]
        shape = [int(d) if isinstance(d, tirx.IntImm) else d for d in old.ty.shape.values]
        shape[axis] = cap
        nv = relax.Var(old.name, relax.TensorType(shape, old.ty.dtype))
        new_params[i] = nv
        caps[old] = (nv, axis)

    def static(d):
        return int(d) if isinstance(d, tirx.IntImm) else None

    @mutator
    class _M(PyExprMutator):
        def __init__(self, mod):
            super().__init__(mod)
            self.written: dict = {}  # concat var (old) -> (written buffer var, axis, present length)
            self.kernels: dict = {}
            self.writers: dict = {}

        def _writer(self, cap_ty, rows_ty, axis):
            key = (tuple(map(str, cap_ty.shape.values)), tuple(map(str, rows_ty.shape.values)), axis, cap_ty.dtype)
            if key not in self.writers:
                fn = write_rows_kernel([static(d) for d in cap_ty.shape.values],
                                       [static(d) for d in rows_ty.shape.values], axis, cap_ty.dtype)
                self.writers[key] = add_kernel(self.builder_, fn, "kv_write_rows")
            return self.writers[key]

        def _emit(self, b, value, name=None):
            """Bound as b.var was: an output of its dataflow block if b.var is one."""
            if isinstance(b.var, relax.DataflowVar) or not self.builder_.current_block_is_dataflow():
                return self.builder_.emit(value, name or b.var.name)
            return self.builder_.emit_output(value, name or b.var.name)

        def visit_var_binding_(self, b):
            v = b.value
            if isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.concat" \
                    and isinstance(v.args[0], relax.Tuple) and len(v.args[0].fields) == 2 \
                    and v.args[0].fields[0] in caps:
                past, rows = v.args[0].fields
                buf, axis = caps[past]
                rank = len(buf.ty.shape.values)
                if int(v.attrs.axis) % rank != axis:
                    raise BlockforgeError(f"{past.name} is concatenated along axis {int(v.attrs.axis)}, "
                                          f"its cache axis is {axis}")
                rows = self.visit_expr(rows)
                s = rows.ty.shape.values[axis]
                call = relax.call_tir_inplace(self._writer(buf.ty, rows.ty, axis),
                                              [buf, rows, relax.prim_value(pvar)], [0], buf.ty)
                w = self._emit(b, call, b.var.name + "_inplace")
                self.written[b.var] = (w, axis, pvar + s)
                # other readers (not rewritten below): the rows [0, P + S) as a tensor of their own
                view = self._emit(b, relax.op.strided_slice(w, [axis], [0], [pvar + s], assume_inbound=True))
                self.set_var_remap(b.var, view)
                return
            if isinstance(v, relax.Call) and getattr(v.op, "name", None) == "relax.call_tir":
                kf = mod[v.args[0]] if isinstance(v.args[0], tvm.ir.GlobalVar) else None
                fields = list(v.args[1].fields)
                if isinstance(kf, tirx.PrimFunc) and kf.attrs is not None and KERNEL_ATTR in kf.attrs \
                        and OPTIONS_ATTR in kf.attrs and len(fields) >= 3 \
                        and fields[1] in self.written and fields[2] in self.written:
                    spec = AttentionSpec.from_json(str(kf.attrs[KERNEL_ATTR]))
                    (kb, ka, n), (vb, va, _) = self.written[fields[1]], self.written[fields[2]]
                    if spec.skv is None and not spec.same_len and spec.kv_capacity is None \
                            and spec.k.index("s") == ka and spec.v.index("s") == va:
                        from dataclasses import replace

                        cspec = replace(spec, kv_capacity=cap)
                        if cspec not in self.kernels:
                            self.kernels[cspec] = add_kernel(self.builder_, rebuilt_kernel(kf, cspec),
                                                             "fused_attention_kv")
                        args = [self.visit_expr(fields[0]), kb, vb, *(self.visit_expr(x) for x in fields[3:]),
                                relax.prim_value(n)]
                        out = self._emit(b, relax.call_tir(self.kernels[cspec], args, v.ty))
                        self.set_var_remap(b.var, out)
                        return
            if isinstance(v, relax.Tuple) and any(x in self.written for x in v.fields):
                t = relax.Tuple([self.written[x][0] if x in self.written else self.visit_expr(x) for x in v.fields])
                self.set_var_remap(b.var, self._emit(b, t))
                return
            super().visit_var_binding_(b)

    m = _M(mod)
    body = m.visit_expr(func.body)
    body = relax.analysis.remove_all_unused(relax.Function(new_params, body, None, func.is_pure)).body
    used = relax.analysis.free_vars(body)
    stale = [p.name for p in caps if p in used]
    if stale:
        raise BlockforgeError(f"cannot write the KV cache in place: {stale[0]} is read other than by its Concat")
    if len(m.written) != len(pairs):
        raise BlockforgeError(f"cannot write the KV cache in place: {len(m.written)} of {len(pairs)} caches are a "
                              "Concat(past, new) this rewrite knows")
    new = relax.Function(new_params, body, None, func.is_pure)
    for k, v in func.attrs.items():
        if k not in (CAP_ATTR, PAIRS_ATTR):
            new = new.with_attr(k, v)
    out = m.builder_.get()
    out[gv] = new
    return out


def inplace_report(mod, name: str = INPLACE_ENTRY) -> dict[str, int]:
    """How the entry reads its caches: calls of kv_write_rows, capacity attention kernels, and
    slices [0, P + S) of a buffer (a reader not rewritten: a copy per step)."""
    from tvm import relax, tirx

    from blockforge.compile.attention.flash import KERNEL_ATTR, AttentionSpec

    found = {"writes": 0, "attention": 0, "slices": 0}
    written = set()
    for blk in mod[name].body.blocks:
        for b in blk.bindings:
            e = b.value
            op = getattr(e.op, "name", None) if isinstance(e, relax.Call) else None
            if op == "relax.call_tir_inplace":
                found["writes"] += 1
                written.add(b.var)
            elif op == "relax.call_tir":
                f = mod[e.args[0]]
                if isinstance(f, tirx.PrimFunc) and f.attrs is not None and KERNEL_ATTR in f.attrs \
                        and AttentionSpec.from_json(str(f.attrs[KERNEL_ATTR])).kv_capacity:
                    found["attention"] += 1
            elif op == "relax.strided_slice" and e.args[0] in written:
                found["slices"] += 1
    return found


def inplace_record(capacity: int, dim: str) -> dict:
    return {"function": INPLACE_ENTRY, "capacity": capacity, "dim": dim}
