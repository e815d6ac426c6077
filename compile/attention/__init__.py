"""Fused CPU attention: softmax(Q K^T * scale [+ mask]) V in one kernel, flash-style.

    for (batch, head, query tile) in parallel:           # QT query rows
        acc[QT, Dv] = 0;  m[QT] = -inf;  l[QT] = 0        # running max and sum
        for key tile k0 (KT keys; causal: only tiles at or left of the diagonal):
            s[QT, KT] = Q[q0:, :] K^T[:, k0:] * scale (+ add) (where keep else fill)
            m' = max(m, rowmax s);  p = exp(s - m');  alpha = exp(m - m')
            l = l alpha + rowsum p;  acc = acc alpha + p V[k0:, :];  m = m'
        O[q0:, :] = acc / l

The S x S scores never reach memory. Q K^T is a register-tiled micro-kernel (MR query
rows x KT keys, vectorised along the keys of K^T, which the graph already lays out as
(.., d, S)); P V is one too (MR rows x Dv, vectorised along Dv); exp is a vectorisable
polynomial (topi.fast_exp's). Accumulation is float32 for float16 models.

The Relax pass (`fuse_attention`) finds matmul(Q, K^T) -> [* or / const] -> [+ mask]
-> [where(keep, ., fill)] -> softmax(-1) -> [where(isnan(P), 0, P)] -> matmul(., V) (SDPA's
export also scales Q and K^T by sqrt(scale) each, and may repeat K/V for grouped-query
heads: both are read through, the kernel indexing the kv heads) and replaces it by a call_tir
of this kernel, reading Q, V and writing O in the layouts the graph has around it
(absorbing the head transposes), and merging the seed's h per-head attentions over
split projections into one multi-head call. Tile sizes come from the tuning database
(`tile_record`) or the defaults.
"""

from blockforge.compile.attention.flash import AttentionSpec, KERNEL_ATTR, KEY_ROWS, kernel, is_kernel, default_tiles, tile_candidates, acc_regs, fast_exp
from blockforge.compile.attention.fuse import fuse_attention, kernel_specs
from blockforge.compile.attention.match import find_attention
from blockforge.compile.attention.tiles import workload, encode_tiles, decode_tiles, tile_trace, tiles_from_trace, tile_record

__all__ = ['AttentionSpec', 'KERNEL_ATTR', 'KEY_ROWS', 'acc_regs', 'decode_tiles', 'default_tiles', 'encode_tiles', 'fast_exp', 'find_attention', 'fuse_attention', 'is_kernel', 'kernel', 'kernel_specs', 'tile_candidates', 'tile_record', 'tile_trace', 'tiles_from_trace', 'workload']
