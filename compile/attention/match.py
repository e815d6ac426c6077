"""The Relax matcher: softmax(Q K^T * scale + mask) V subgraphs (and per-head groups of
them) found in an imported model."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import numpy as np

from blockforge.compile.attention.flash import AttentionSpec


_log = logging.getLogger("blockforge.attention")
# Addends of the scores the kernel takes, summed into its one additive mask before the call
# (a bias and a mask: MPNet, whose attention was left unfused)
MAX_ADDENDS = 3


def _is_call(e, *names):
    from tvm import relax

    return isinstance(e, relax.Call) and getattr(e.op, "name", None) in names


def static_shape(e) -> list | None:
    ty = getattr(e, "ty", None)
    shape = getattr(ty, "shape", None)
    if shape is None or not hasattr(shape, "__len__"):
        return None
    return list(shape)


def _dtype(e) -> str | None:
    return str(getattr(getattr(e, "ty", None), "dtype", None))


def static_int(d) -> int | None:
    from tvm import tirx

    return int(d.value) if isinstance(d, tirx.IntImm) else None


def same_dim(a, b) -> bool:
    import tvm_ffi

    sa, sb = static_int(a), static_int(b)
    if sa is not None or sb is not None:
        return sa == sb
    return a.same_as(b) or tvm_ffi.structural_equal(a, b)


def _per_head_const(e) -> np.ndarray | None:
    """The values of a float constant of shape (H, 1, 1) or (1, H, 1, 1) (one per head of (B,
    H, Sq, Skv) scores), flattened, else None."""
    value = getattr(e, "value", None)
    if value is None or not hasattr(value, "numpy"):
        return None
    a = value.numpy()
    if a.dtype.kind != "f" or a.ndim not in (3, 4) or a.shape[-2:] != (1, 1) or (a.ndim == 4 and a.shape[0] != 1):
        return None
    return a.reshape(-1).astype(np.float64)


def _const_operand(c, read):
    """(read(the constant), the other operand) of a divide or multiply call `c`: the constant is
    the divisor, or either factor; read's None when neither operand is one it reads."""
    a, b = c.args
    k = read(b)
    if k is None and c.op.name == "relax.multiply":
        k, a = read(a), b
    return k, a


def _scalar_const(e) -> float | None:
    """The value of a constant with one element (shape () or all ones), else None."""
    value = getattr(e, "value", None)
    if value is None or not hasattr(value, "numpy"):
        return None
    a = value.numpy()
    return float(a.reshape(-1)[0]) if a.size == 1 and a.dtype.kind == "f" else None


@dataclass
class Match:
    """One attention subgraph, as found: Relax expressions and the kernel spec they need."""
    out: object  # the var bound to the final matmul(P, V) (or the absorbed output permute)
    q: object
    kt: object
    v: object
    add: object
    keep: object
    spec: AttentionSpec
    out_shape: list
    chain: list  # the intermediate vars (scores .. probabilities, P V), each used once
    lead: list  # leading dims of the scores (batch[, heads])
    k_src: object = None  # grouped-query: K (B, Hkv, S, d), transposed at the call (kt unused)
    head_scale: object = None  # (H,) float32: scores of head h times head_scale[h], applied to Q at the call


class _Finder:
    """Matches attention subgraphs in one Relax function (by its bindings and use counts)."""

    def __init__(self, func, key_rows: bool = True):
        from tvm import relax

        self.key_rows = key_rows
        self.v2v = relax.analysis.get_var2val(func)
        self.why: dict = {}  # softmax var -> why its attention is not fused
        self.uses: dict = {}  # var -> number of bindings (and the function result) using it
        self._users: dict = {}
        values = [b.value for blk in func.body.blocks for b in blk.bindings]
        bvars = [b.var for blk in func.body.blocks for b in blk.bindings]
        for bv, val in [*zip(bvars, values), (None, func.body.body)]:
            for v in relax.analysis.free_vars(val):
                self.uses[v] = self.uses.get(v, 0) + 1
                if bv is not None:
                    self._users.setdefault(v, []).append((bv, val))

    def value(self, e):
        from tvm import relax

        return self.v2v.get(e, e) if isinstance(e, relax.Var) else e

    def once(self, e) -> bool:
        return self.uses.get(e, 0) == 1

    def call(self, e, *names):
        c = self.value(e)
        return c if _is_call(c, *names) else None

    def users(self, var) -> list:
        """(bound var, value) of the bindings that use `var`."""
        return self._users.get(var, [])

    # -- the chain, from the final matmul back to the scores
    def match(self, out_var, value) -> Match | None:
        from tvm import relax

        chain = []
        if _is_call(value, "relax.reshape"):
            # P V as a (batch*heads) matmul between reshapes (torch.export's decomposed SDPA)
            flat = self._unflatten(out_var)
            if flat is None:
                return None
            _, probs, v, chain = flat
        elif not _is_call(value, "relax.matmul") or len(value.args) != 2:
            return None
        else:
            probs, v = value.args
        if not isinstance(probs, relax.Var) or not self.once(probs):
            return None
        chain.append(probs)
        guard = self._nan_guard(probs)
        safe = None if guard is not None else self._safe_softmax_guard(probs)
        if guard is not None:
            probs, isnan = guard
            chain += [isnan, probs]
        elif safe is not None:
            probs, cond = safe
            chain += [cond, probs]
        sm = self.call(probs, "relax.nn.softmax")
        if sm is None:
            return None
        why = lambda reason: self.no(probs, reason)  # noqa: E731
        x = sm.args[0]
        rank = len(static_shape(x) or [])
        if rank not in (3, 4) or int(sm.attrs.axis) not in (-1, rank - 1):
            return why(f"softmax over axis {int(sm.attrs.axis)} of a rank-{rank} tensor, not the keys of (B[, H], S, S)")
        keep = fill = None
        # the safe-softmax guard reads the scores too (its all -inf test): their one other use
        if not (isinstance(x, relax.Var) and self.uses.get(x, 0) == (2 if safe is not None else 1)):
            return why("the scores are used outside the attention")
        c = self.value(x)
        if _is_call(c, "relax.where"):
            keep, x, fill = c.args[0], c.args[1], _scalar_const(c.args[2])
            if fill is None and _scalar_const(x) is not None:
                # DeBERTa: where(~mask, fill, scores) (masked_fill of the negated mask); a constant
                # mask's negation was folded at import (a causal tril): negated back here
                neg, const = self.value(keep), getattr(keep, "value", None)
                if _is_call(neg, "relax.logical_not"):
                    keep, x, fill = neg.args[0], c.args[2], _scalar_const(c.args[1])
                elif hasattr(const, "numpy") and const.numpy().dtype == bool:
                    keep, x, fill = relax.const(~const.numpy()), c.args[2], _scalar_const(c.args[1])
            if fill is None or _dtype(keep) != "bool":
                return why("where(mask, scores, fill) with a fill that is not a scalar constant")
            chain.append(x)
            if not (isinstance(x, relax.Var) and self.once(x)):
                return None
            c = self.value(x)
        add = None
        addends = []  # ((s + a) + b): MPNet adds its relative-position bias, then the mask
        while _is_call(c, "relax.add") and len(addends) < MAX_ADDENDS:
            a, b = c.args
            if a.same_as(b):
                return None
            for s_, m_ in ((a, b), (b, a)):
                if self._leads_to_scores(s_, MAX_ADDENDS - len(addends)):
                    x = s_
                    addends.append(m_)
                    break
            else:
                return why("an add before softmax whose scores side is not Q K^T [* scale]")
            chain.append(x)
            c = self.value(x)
        if addends:
            if _is_call(c, "relax.add"):
                return why(f"more than {MAX_ADDENDS} adds before softmax")
            add = addends[0] if len(addends) == 1 else tuple(reversed(addends))
        softcap = None
        cap = self._softcap(x) if _is_call(c, "relax.multiply") else None
        if cap is not None:  # Gemma 2: tanh(scores / cap) * cap
            softcap, inner, x, vars_ = cap
            chain += vars_
            c = self.value(x)
        scale, head_scale = 1.0, None
        if _is_call(c, "relax.divide", "relax.multiply"):
            div = c.op.name == "relax.divide"
            k, a = _const_operand(c, _scalar_const)
            if k is None:  # a scale per head (Swin V2's cosine attention: its learnt logit scale)
                head_scale, a = _const_operand(c, _per_head_const)
                if head_scale is None or (div and not head_scale.all()):
                    return why("the scores are scaled by a tensor that is neither a scalar nor one value per head")
                head_scale = 1.0 / head_scale if div else head_scale
                k = 1.0
            if not (isinstance(a, relax.Var) and self.once(a)) or (div and k == 0):
                return None
            scale = 1.0 / k if div else k
            x = a
            chain.append(x)
            c = self.value(x)
        flat = self._unflatten(x) if _is_call(c, "relax.reshape") and self.once(x) else None
        if flat is not None:
            c, q, kt, inner = flat
            chain += inner
        elif not _is_call(c, "relax.matmul") or len(c.args) != 2:
            return why(f"the scores come from {getattr(getattr(c, 'op', None), 'name', type(c).__name__)}, "
                       "not matmul(Q, K^T) [* or / a scalar constant] [+ mask] [where]")
        else:
            q, kt = c.args
        if c.attrs.out_dtype not in (None, "") and str(c.attrs.out_dtype) not in ("void", _dtype(c.args[0])):
            return why(f"Q K^T accumulates in {c.attrs.out_dtype}")
        # SDPA's export scales both operands by sqrt(scale): (Q*c)(K^T*c) = Q K^T c^2
        q, kq = self._peel_scale(q)
        kt, kk = self._peel_scale(kt)
        scale *= kq * kk
        m = self._shapes(out_var, value, q, kt, v, add, keep, fill, scale, chain)
        if m is None:
            return why("shapes the kernel does not take (dtype, rank, symbolic heads or d, broadcast batch, mask dims)")
        if softcap is not None:
            m.spec = replace(m.spec, softcap=softcap, scale=m.spec.scale * inner)
        if head_scale is not None:
            if len(m.lead) != 2 or head_scale.size not in (1, m.spec.heads):
                return why(f"a scale per head of {head_scale.size} values over {m.spec.heads} heads")
            if (head_scale == head_scale.flat[0]).all():
                m.spec = replace(m.spec, scale=m.spec.scale * float(head_scale.flat[0]))
            else:
                m.head_scale = np.broadcast_to(head_scale, (m.spec.heads,)).astype(np.float32)
        if guard is not None:
            m.spec = replace(m.spec, nan_rows_zero=True)
        if safe is not None:
            m.spec = replace(m.spec, inf_rows_zero=True)
        return self._key_rows(self._ungroup(m))

    def _key_rows(self, m: Match) -> Match:
        """One query row (a decode step at a bound seq = 1): read K as the graph has it before
        its transpose to K^T (B, H, S, d), the kernel's dot-product form. The transpose would
        otherwise copy the whole cached K every step; measured at S = 1 the dot products are
        no slower than the K^T micro-kernel, at S = 5 and 128 slower (kept K^T there)."""
        if not self.key_rows or m.spec.sq != 1 or m.spec.k != "bhds":
            return m
        x = m.k_src if m.k_src is not None else self._kt_source(m.kt)
        if x is None:
            return m
        m.kt, m.k_src = x, None
        m.spec = replace(m.spec, k="bhsd")
        return m

    def no(self, softmax_var, reason: str) -> None:
        """Record why the attention around `softmax_var` is not fused (find_attention logs it)."""
        self.why[softmax_var] = reason
        return None

    def _nan_guard(self, probs):
        """where(isnan(p), 0, p) over a softmax p (SDPA zeroes NaN rows so): (p, the isnan var), else None."""
        c = self.call(probs, "relax.where")
        if c is None or len(c.args) != 3 or _scalar_const(c.args[1]) != 0.0:
            return None
        cond, p = c.args[0], c.args[2]
        isnan = self.call(cond, "relax.isnan")
        if isnan is None or not isnan.args[0].same_as(p) or not self.once(cond) or self.uses.get(p, 0) != 2:
            return None
        return (p, cond) if self.call(p, "relax.nn.softmax") is not None else None

    def _safe_softmax_guard(self, probs):
        """torch's _safe_softmax as torch.export decomposes it: where(all(x == -inf) over the
        keys, 0, softmax(x)), the all as not(bool(max(int64(not(x == -inf)), -1, keepdims))).
        (softmax var, the condition var), else None. Unlike where(isnan(p), 0, p), a row with a
        NaN or +inf score stays NaN: the kernel's inf_rows_zero."""
        c = self.call(probs, "relax.where")
        if c is None or len(c.args) != 3 or not self._is_zero(c.args[1]):
            return None
        cond, p = c.args[0], c.args[2]
        sm = self.call(p, "relax.nn.softmax")
        if sm is None or not (self.once(p) and self.once(cond)) or not _same_shape(probs, p):
            return None
        e = cond
        for op in ("relax.logical_not", "relax.astype", "relax.max", "relax.astype", "relax.logical_not"):
            call = self.call(e, op)
            if call is None or (e is not cond and not self.once(e)):
                return None
            if op == "relax.max":
                rank = len(static_shape(call.args[0]) or [])
                axes = [int(a) for a in call.attrs.axis] if call.attrs.axis is not None else []
                if not call.attrs.keepdims or axes not in ([-1], [rank - 1]):
                    return None
            e = call.args[0]
        eq = self.call(e, "relax.equal")
        if eq is None or not self.once(e) or not eq.args[0].same_as(sm.args[0]) or _scalar_const(eq.args[1]) != -math.inf:
            return None
        return p, cond

    def _is_zero(self, e) -> bool:
        """A constant of zeros (scalar or folded tensor), or broadcast_to of a scalar 0."""
        c = self.call(e, "relax.broadcast_to")
        if c is not None:
            e = c.args[0]
        value = getattr(self.value(e), "value", None)
        if value is None or not hasattr(value, "numpy"):
            return False
        a = value.numpy()
        return a.dtype.kind == "f" and bool((a == 0).all())

    def _unflatten(self, var):
        """var = reshape(matmul(reshape(A), reshape(B))) where A, B are (batch, heads, ..)
        rank-4 and the matmul is their (batch*heads) rank-3 form: (the matmul call, A, B, the
        intermediate vars), else None. torch.export's decomposition writes SDPA's two products so."""
        r = self.call(var, "relax.reshape")
        inner = r.args[0] if r is not None else None
        mm = self.call(inner, "relax.matmul") if inner is not None else None
        if mm is None or len(mm.args) != 2 or not self.once(inner):
            return None
        out4, out3 = static_shape(var), static_shape(inner)
        srcs = []
        for x3 in mm.args:
            rs = self.call(x3, "relax.reshape")
            x4 = rs.args[0] if rs is not None else None
            if x4 is None or not _merges_heads(static_shape(x4), static_shape(x3)):
                return None
            srcs.append(x4)
        a4, b4 = (static_shape(x) for x in srcs)
        if not _merges_heads(out4, out3) or not all(same_dim(x, y) for x, y in zip(a4[:2], out4[:2])) \
                or not all(same_dim(x, y) for x, y in zip(b4[:2], out4[:2])):
            return None
        return mm, srcs[0], srcs[1], [inner, *mm.args]

    def _peel_scale(self, e):
        """(x, k) when e = x * k, k * x or x / k for a scalar constant k used only here, else (e, 1)."""
        c = self.call(e, "relax.multiply", "relax.divide")
        if c is None or not self.once(e):
            return e, 1.0
        k, a = _const_operand(c, _scalar_const)
        if k is None or (c.op.name == "relax.divide" and k == 0) or not math.isfinite(k):
            return e, 1.0
        return a, (1.0 / k if c.op.name == "relax.divide" else k)

    def _ungroup(self, m: Match) -> Match:
        """Grouped-query attention: K and V each repeated from kv heads (expand_dims ->
        broadcast_to -> reshape, HF's repeat_kv). The kernel reads the kv heads instead."""
        if len(m.lead) != 2 or m.spec.v != "bhsd" or m.spec.k != "bhds":
            return m
        v = self._repeat_source(m.v)
        x = self._kt_source(m.kt)
        k = self._repeat_source(x) if x is not None else None
        if v is None or k is None or v[1] != k[1] or m.spec.heads % v[1]:
            if v is not None or k is not None:
                _log.info("grouped-query attention: the key/value repeat is kept (K and V not both a repeat "
                          "of the same kv heads)")
            return m
        m.v, m.k_src = v[0], k[0]
        m.spec = replace(m.spec, kv_heads=v[1])
        return m

    def _repeat_source(self, e):
        """(src (B, Hkv, S, d), Hkv) when e = reshape(broadcast_to(expand_dims(src, 2), (B, Hkv, g, S, d)), (B, Hkv*g, S, d))."""
        r = self.call(e, "relax.reshape")
        bc = self.call(r.args[0], "relax.broadcast_to") if r is not None else None
        ed = self.call(bc.args[0], "relax.expand_dims") if bc is not None else None
        if ed is None or [int(a) for a in ed.attrs.axis] != [2]:
            return None
        src, rs, bs = ed.args[0], static_shape(e), static_shape(r.args[0])
        ss = static_shape(src)
        if ss is None or rs is None or bs is None or len(ss) != 4 or len(bs) != 5 or len(rs) != 4:
            return None
        hkv, g = static_int(bs[1]), static_int(bs[2])
        if hkv is None or g is None or static_int(ss[1]) != hkv or static_int(rs[1]) != hkv * g:
            return None
        if not all(same_dim(a, b) for a, b in ((ss[0], rs[0]), (ss[2], rs[2]), (ss[3], rs[3]))):
            return None
        return src, hkv

    def _kt_source(self, kt):
        """X (B, H, S, d) when kt = X^T on its last two axes (one permute, or the dynamo
        exporter's reshape (B*H, S, d) -> permute -> reshape (B, H, d, S)), else None."""
        p = self.call(kt, "relax.permute_dims")
        if p is not None and p.attrs.axes is not None and [int(a) for a in p.attrs.axes] == [0, 1, 3, 2]:
            return p.args[0]
        r2 = self.call(kt, "relax.reshape")
        p = self.call(r2.args[0], "relax.permute_dims") if r2 is not None else None
        if p is None or p.attrs.axes is None or [int(a) for a in p.attrs.axes] != [0, 2, 1]:
            return None
        r1 = self.call(p.args[0], "relax.reshape")
        if r1 is None:
            return None
        x, xs, ks = r1.args[0], static_shape(r1.args[0]), static_shape(kt)
        if xs is None or ks is None or len(xs) != 4 or len(ks) != 4:
            return None
        same = all(same_dim(a, b) for a, b in ((xs[0], ks[0]), (xs[1], ks[1]), (xs[2], ks[3]), (xs[3], ks[2])))
        return x if same else None

    def _softcap(self, x):
        """(cap, k, z, the vars from x to z) when x = tanh(z * k) * cap, with k a scalar constant
        (the graph's divide by cap, or its multiply by 1 / cap; 1 when absent) and cap a finite
        positive scalar constant, every var used once; else None."""
        from tvm import relax

        c = self.call(x, "relax.multiply")
        if c is None:
            return None
        cap, t = _const_operand(c, _scalar_const)
        if cap is None or not (math.isfinite(cap) and cap > 0) or not (isinstance(t, relax.Var) and self.once(t)):
            return None
        th = self.call(t, "relax.tanh")
        if th is None or not (isinstance(th.args[0], relax.Var) and self.once(th.args[0])):
            return None
        y = th.args[0]
        z, k = self._peel_scale(y)
        if z is y:
            return cap, 1.0, y, [t, y]
        if not isinstance(z, relax.Var) or not self.once(z):
            return None
        return cap, k, z, [t, y, z]

    def _leads_to_scores(self, e, adds: int) -> bool:
        """e (used once) is the scores, or an add of them and something else, at most `adds` deep."""
        from tvm import relax

        if not (isinstance(e, relax.Var) and self.once(e)):
            return False
        if self._is_scores_side(e):
            return True
        c = self.value(e)
        return adds > 1 and _is_call(c, "relax.add") and any(self._leads_to_scores(a, adds - 1) for a in c.args)

    def _is_scores_side(self, e) -> bool:
        c = self.value(e)
        return _is_call(c, "relax.divide", "relax.multiply", "relax.matmul") or \
            (_is_call(c, "relax.reshape") and self._unflatten(e) is not None)

    def _shapes(self, out_var, value, q, kt, v, add, keep, fill, scale, chain) -> Match | None:
        sq_, sk_, sv_ = static_shape(q), static_shape(kt), static_shape(v)
        dtype = _dtype(q)
        if dtype not in ("float32", "float16") or {_dtype(kt), _dtype(v), _dtype(out_var)} != {dtype}:
            return None
        if sq_ is None or sk_ is None or sv_ is None or not (len(sq_) == len(sk_) == len(sv_) in (3, 4)):
            return None
        rank = len(sq_)
        lead = sq_[:-2]
        if not all(same_dim(a, b) for a, b in zip(lead, sk_[:-2])) or \
                not all(same_dim(a, b) for a, b in zip(lead, sv_[:-2])):
            return None  # broadcast batch dims: not handled by the kernel
        d, dv = static_int(sq_[-1]), static_int(sv_[-1])
        if d is None or dv is None or not same_dim(sq_[-1], sk_[-2]) or not same_dim(sk_[-1], sv_[-2]):
            return None
        if rank == 4 and static_int(lead[1]) is None:
            return None  # heads must be static
        sq, skv = sq_[-2], sk_[-1]
        scores = [*lead, sq, skv]
        letters = ["b", "h", "q", "k"] if rank == 4 else ["b", "q", "k"]
        add_dims = keep_dims = None
        causal = False
        if add is not None:
            parts = add if isinstance(add, tuple) else (add,)
            if {_dtype(a) for a in parts} - {"float32", "float16"} or len({_dtype(a) for a in parts}) != 1:
                return None
            add_dims = _mask_dims(_broadcast_shape([static_shape(a) for a in parts]), scores, letters)
            if add_dims is None:
                return None
        if keep is not None:
            terms = self._and_terms(keep)
            rest = [t for t in terms if not self._is_causal(t, sq, skv)]
            causal = len(rest) < len(terms)
            if len(rest) > 1:
                rest, causal = [keep], False  # several mask tensors: pass their product
            keep = rest[0] if rest else None
            if keep is not None:
                keep_dims = _mask_dims(static_shape(keep), scores, letters)
                if keep_dims is None:
                    return None
        same_len = static_int(sq) is None and sq.same_as(skv)
        spec = AttentionSpec(
            dtype=dtype, q="bhsd" if rank == 4 else "bsd", k="bhds" if rank == 4 else "bds",
            v="bhsd" if rank == 4 else "bsd", o="bhsd" if rank == 4 else "bsd",
            heads=static_int(lead[1]) if rank == 4 else 1, d=d, dv=dv, scale=float(scale),
            batch=static_int(lead[0]), sq=static_int(sq), skv=static_int(skv),
            add=add_dims, add_dtype=_dtype(parts[0]) if add is not None else "float32", keep=keep_dims,
            causal=causal, fill=fill if (keep is not None or causal) else None, same_len=same_len)
        m = Match(out_var, q, kt, v, add, keep, spec, [*lead, sq, dv], chain + [out_var], list(lead))
        return self._absorb(m) if rank == 4 else m

    def _and_terms(self, e) -> list:
        c = self.call(e, "relax.logical_and")
        if c is None:
            return [e]
        return self._and_terms(c.args[0]) + self._and_terms(c.args[1])

    def _is_causal(self, e, sq, skv) -> bool:
        """tril(all-true (S, S)) as the importer builds it for a symbolic seq, or its folded constant."""
        shape = static_shape(e)
        if shape is None or len(shape) < 2 or not same_dim(shape[-2], sq) or not same_dim(shape[-1], skv):
            return False
        if any(static_int(s) != 1 for s in shape[:-2]):
            return False
        value = getattr(self.value(e), "value", None)
        if value is not None and hasattr(value, "numpy"):
            a = value.numpy()
            a2 = a.reshape(a.shape[-2:])
            return a.dtype == np.bool_ and bool(np.array_equal(a2, np.tril(np.ones_like(a2))))
        c = self.call(e, "relax.tril")
        if c is None or len(c.args) < 2 or static_int(c.args[1]) != 0:
            return False
        src = self.value(c.args[0])
        if _is_call(src, "relax.broadcast_to"):
            src = self.value(src.args[0])
        elif _is_call(src, "relax.full"):  # ConstantOfShape of a symbolic shape (frontend/symbolic)
            src = self.value(src.args[1])
        value = getattr(src, "value", None)
        return value is not None and hasattr(value, "numpy") and value.numpy().dtype == np.bool_ \
            and bool(value.numpy().all())

    def _absorb(self, m: Match) -> Match:
        """Read Q/V through the (B, S, H, d) -> (B, H, S, d) transposes around them, and write
        the output in (B, S, H, dv) when its one consumer transposes it so."""
        spec = m.spec
        for name in ("q", "v"):
            c = self.call(getattr(m, name), "relax.permute_dims")
            if c is not None and c.attrs.axes is not None and [int(a) for a in c.attrs.axes] == [0, 2, 1, 3]:
                setattr(m, name, c.args[0])
                spec = replace(spec, **{name: "bshd"})
        if self.once(m.out):
            users = self.users(m.out)
            if len(users) == 1:
                uv, uval = users[0]
                if _is_call(uval, "relax.permute_dims") and uval.attrs.axes is not None and \
                        [int(a) for a in uval.attrs.axes] == [0, 2, 1, 3]:
                    m.out = uv
                    m.chain.append(uv)
                    b, h, s, dv = m.out_shape
                    m.out_shape = [b, s, h, dv]
                    spec = replace(spec, o="bshd")
        m.spec = spec
        return m


def _same_shape(a, b) -> bool:
    sa, sb = static_shape(a), static_shape(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(same_dim(x, y) for x, y in zip(sa, sb))


def _merges_heads(s4: list | None, s3: list | None) -> bool:
    """s3 is s4 = (B, H, x, y) with B and H merged: (B*H, x, y)."""
    import tvm

    if s4 is None or s3 is None or len(s4) != 4 or len(s3) != 3:
        return False
    if not (same_dim(s4[2], s3[1]) and same_dim(s4[3], s3[2])):
        return False
    b, h, bh = static_int(s4[0]), static_int(s4[1]), static_int(s3[0])
    if b is not None and h is not None:
        return bh == b * h
    return bh is None and tvm.sym.Analyzer().can_prove_equal(s4[0] * s4[1], s3[0])


def _broadcast_shape(shapes: list) -> list | None:
    """The shape of the sum of tensors of these shapes (right-aligned broadcasting), or None
    where a shape is unknown or two extents differ and neither is 1."""
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        wide = [d for d in dims if static_int(d) != 1]
        if any(not same_dim(d, wide[0]) for d in wide[1:]):
            return None
        out.append(wide[0] if wide else dims[0])
    return out


def _mask_dims(shape: list | None, scores: list, letters: list) -> tuple[str, ...] | None:
    """Which score axis each axis of a mask of `shape` follows (right-aligned broadcasting), or None."""
    if shape is None or len(shape) > len(scores):
        return None
    out = []
    for i, d in enumerate(shape):
        j = len(scores) - len(shape) + i
        if static_int(d) == 1:
            out.append("1")
        elif same_dim(d, scores[j]):
            out.append(letters[j])
        else:
            return None
    return tuple(out)


def _split_item(f: _Finder, e, rank: int):
    """(split call's input, item index, sections) when `e` is item i of an even split on
    the last axis of a rank-`rank` tensor, else None."""
    from tvm import relax

    item = f.value(e)
    if not isinstance(item, relax.TupleGetItem):
        return None
    sp = f.call(item.tuple_value, "relax.split")
    if sp is None or int(sp.attrs.axis) not in (-1, rank - 1):
        return None
    x = sp.args[0]
    shape = static_shape(x)
    width = static_int(shape[-1]) if shape else None
    ios = sp.attrs.indices_or_sections
    if width is None:
        return None
    if isinstance(ios, int) or static_int(ios) is not None:
        n = int(ios) if isinstance(ios, int) else static_int(ios)
    else:
        idx = [static_int(i) for i in ios]
        n = len(idx) + 1
        if width % n or idx != [width // n * (k + 1) for k in range(n - 1)]:
            return None
    if width % n:
        return None
    return x, int(item.index), n, item.tuple_value


@dataclass
class Heads:
    """h per-head attentions over an even split of packed projections, concatenated in order."""
    out: object  # the concat's var
    xq: object
    xk: object
    xv: object
    first: Match


def _merge_heads(f: _Finder, matches: list[Match]) -> tuple[list, set]:
    """Group the seed's per-head matches into multi-head calls; returns (groups, merged outs)."""
    from tvm import relax

    by_out = {m.out: m for m in matches if m.spec.q == "bsd"}
    groups, merged = [], set()
    for bv, val in f.v2v.items():
        if not _is_call(val, "relax.concat") or not isinstance(val.args[0], relax.Tuple):
            continue
        outs = list(val.args[0].fields)
        ms_ = [by_out.get(o) for o in outs]
        if len(outs) < 2 or any(m is None or not f.once(m.out) for m in ms_):
            continue
        if int(val.attrs.axis) not in (-1, 2):
            continue
        first = ms_[0]
        same = all(m.spec == first.spec and _same_expr(m.add, first.add) and _same_expr(m.keep, first.keep)
                   for m in ms_)
        if not same:
            continue
        srcs = []
        for m in ms_:
            kt = f.call(m.kt, "relax.permute_dims")
            if kt is None or kt.attrs.axes is None or [int(a) for a in kt.attrs.axes] != [0, 2, 1]:
                break
            q, k, v = _split_item(f, m.q, 3), _split_item(f, kt.args[0], 3), _split_item(f, m.v, 3)
            if q is None or k is None or v is None:
                break
            srcs.append((q, k, v))
        if len(srcs) != len(ms_):
            continue
        h = len(ms_)
        ok = all(s[1] == i and s[2] == h and s[3].same_as(srcs[0][j][3])
                 for i, qkv in enumerate(srcs) for j, s in enumerate(qkv))
        if not ok:
            continue
        groups.append(Heads(bv, srcs[0][0][0], srcs[0][1][0], srcs[0][2][0], first))
        merged.update(m.out for m in ms_)
    return groups, merged


def _same_expr(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(_same_expr, a, b))
    return (a is None and b is None) or (a is not None and b is not None and a.same_as(b))


def find_attention(func, key_rows: bool = True) -> tuple[list[Match], list[Heads]]:
    """The attention subgraphs of a Relax function: single calls and per-head groups.
    key_rows: one query row reads K untransposed (False: as K^T, the ablation)."""
    f = _Finder(func, key_rows)
    matches = []
    for var, val in f.v2v.items():
        m = f.match(var, val)
        if m is not None:
            matches.append(m)
    groups, merged = _merge_heads(f, matches)
    fused = {v for m in matches for v in m.chain}
    for var, val in f.v2v.items():
        if _is_call(val, "relax.nn.softmax") and var not in fused:
            users = [u for _, u in f.users(var)]
            default = ("its probabilities are reshaped before P V (a (batch*heads) rank-3 form around a "
                       "rank-4 softmax, as BLOOM's ALiBi attention)" if users and _is_call(users[0], "relax.reshape")
                       else "its probabilities do not feed one matmul with V [through where(isnan(p), 0, p)]")
            _log.info("attention not fused: softmax %s: %s", var.name, f.why.get(var, default))
    return [m for m in matches if m.out not in merged], groups
