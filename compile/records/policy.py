"""What a tuning record may do: the schedules MetaSchedule's search (and blockforge's own
schedule rules) write, and nothing else.

A record's trace is replayed on the model's own functions at compile time, so a trace is
code: TVM honours loop annotations such as `pragma_import_llvm` (LLVM IR, or a .ll/.bc
file read from disk, linked into the module: a global constructor then runs wherever
module.so is loaded) and `pragma_import_c`, and `pragma_debug_skip_region` drops
computation. Database files travel (shared caches, RPC farms, records in repositories),
so they are untrusted input: every record is checked here before anything reads it
(compile/records.read_contents is the one door), and a record that fails is refused
(with one warning naming it), never applied or handed to TVM.

What passes: the instruction kinds the search's schedule rules, postprocessors and
mutators emit (sampling, getters, loop and block transformations, caching, compute
location, reductions, tensorization); Annotate/Unannotate only with the keys they write,
each with its value type; measured latencies that are finite, positive and above any
call's own overhead. What a valid record can still do is pick which of those schedules
runs (a faster- or slower-looking one): a performance choice, not code.
"""

from __future__ import annotations

import json
import math
import re

# Instruction kinds MetaSchedule's search writes (s_tir/meta_schedule schedule rules:
# multi-level tiling (incl. tensor-core/wide-vector), auto-inline, rfactor,
# cross-thread reduction, parallel-vectorize-unroll, random compute location,
# auto-bind; postprocessors: rewrite-parallel-vectorize-unroll, reduction blocks,
# cooperative fetch, unbound blocks, layout, tensorize) plus what blockforge's rules
# (compile/schedule/) call. Left out although TVM knows them: UnsafeSetDType,
# UnsafeHideBufferAccess, AnnotateBufferAccess (change meaning), and primitives no
# search emits (CacheInplace, CacheIndex, DecomposePadding, RollingBuffer, ReadAt,
# WriteAt, LoopPartition, ReorderBlockIterVar, FuseReductionEpilogue).
SAMPLING = frozenset({"SamplePerfectTile", "SamplePartitionedTile", "SampleCategorical", "SampleComputeLocation"})
KINDS = SAMPLING | frozenset({
    "GetSBlock", "GetLoops", "GetChildBlocks", "GetProducers", "GetConsumers", "GetOutputBlocks",
    "Fuse", "Split", "Merge", "Reorder", "AddUnitLoop", "Parallel", "Vectorize", "Bind", "Unroll",
    "CacheRead", "CacheWrite", "ReindexCacheRead", "ReindexCacheWrite", "ReIndex",
    "ComputeAt", "ReverseComputeAt", "ComputeInline", "ReverseComputeInline",
    "DecomposeReduction", "RFactor", "StorageAlign", "SetScope",
    "TransformLayout", "TransformBlockLayout", "PadEinsum", "Blockize", "Tensorize",
    "Annotate", "Unannotate", "EnterPostproc",
})

INT, INT_OR_VAR, FLAG, NAME, INT_LIST = "int", "int or sampled variable", "flag", "name", "list of ints"
# Annotation keys the search writes, with the type of their value.
ANNOTATIONS = {
    "meta_schedule.tiling_structure": NAME,  # "SSRSRS"
    "meta_schedule.parallel": INT,
    "meta_schedule.vectorize": INT,
    "meta_schedule.unroll_explicit": INT_OR_VAR,
    "meta_schedule.unroll_implicit": INT_OR_VAR,
    "meta_schedule.cooperative_fetch": INT_OR_VAR,
    "meta_schedule.thread_extent_low_inclusive": INT,
    "meta_schedule.thread_extent_high_inclusive": INT,
    "meta_schedule.random_compute_producer": INT,
    "meta_schedule.auto_tensorize": NAME,  # a registered tensor intrinsic
    "meta_schedule.auto_tensorize_init": NAME,
    "meta_schedule.layout_rewrite_preproc": FLAG,
    "software_pipeline_stage": INT_LIST,
    "software_pipeline_order": INT_LIST,
    "software_pipeline_async_stages": INT_LIST,
    "warp_execution": FLAG,
    # the two pragmas RewriteParallelVectorizeUnroll writes, and blockforge's own hint
    "pragma_auto_unroll_max_step": INT,
    "pragma_unroll_explicit": INT,
    "pragma_loop_partition_hint": INT,
}

# TVM object graphs a trace may embed (TransformLayout's index maps, written as TVM JSON):
# variables, constants and index arithmetic. No calls, buffers or statements: an index
# map is code too (a call_extern in an index would run at every access).
OBJECT_TYPES = frozenset({
    "None", "int", "float", "bool", "ffi.Array", "ffi.String", "ir.IntImm", "ir.FloatImm", "ir.PrimType",
    "ir.Var", "tirx.IndexMap", "prim.Add", "prim.Sub", "prim.Mul", "prim.FloorDiv", "prim.FloorMod",
    "prim.Div", "prim.Mod", "prim.Min", "prim.Max",
})

MIN_RUN_SECS = 1e-8  # 10 ns: below the cost of calling any kernel at all
MAX_RUN_SECS = 1e10  # MetaSchedule's value for a candidate that failed to build or run
MAX_INSTS = 20000
_NAME = re.compile(r"[A-Za-z0-9_.]{1,128}$")
_INT_LIMIT = 2 ** 31


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT < v < _INT_LIMIT


def _plain(v, depth: int = 0) -> bool:
    """JSON scalars and (shallow) lists of them: what instruction inputs/attrs are made of."""
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, list) and depth < 4 and all(_plain(x, depth + 1) for x in v)


def _objects_problem(v) -> str | None:
    """Why a TVM JSON object graph inside an instruction is refused (None: not one, or fine)."""
    if isinstance(v, list):
        return next((p for p in map(_objects_problem, v) if p), None)
    if not (isinstance(v, str) and v.lstrip().startswith("{")):
        return None
    try:
        graph = json.loads(v)
        types = {n["type"] for n in graph["nodes"]}
    except (ValueError, TypeError, KeyError):
        return "embeds an object graph that is not TVM JSON"
    bad = sorted(str(t) for t in types - OBJECT_TYPES)
    return f"embeds TVM objects of type {', '.join(bad)[:80]}" if bad else None


def _literal(v) -> str | None:
    """The text of a trace's string literal: TVM writes one as the text between two
    double quotes ('"SSRSRS"'), unescaped."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1]
    return None


def _value_problem(key: str, value, sampled: set[str]) -> str | None:
    want = ANNOTATIONS[key]
    ok = {INT: _is_int(value),
          INT_OR_VAR: _is_int(value) or (isinstance(value, str) and value in sampled),
          FLAG: isinstance(value, bool) or value in (0, 1),
          NAME: _literal(value) is not None and bool(_NAME.match(_literal(value) or "")),
          INT_LIST: isinstance(value, list) and len(value) <= 1024 and all(_is_int(x) for x in value)}[want]
    return None if ok else f"Annotate {key!r} wants a value of type {want}, not {json.dumps(value)[:60]}"


def _trace_problem(trace) -> str | None:
    if not (isinstance(trace, list) and len(trace) == 2 and isinstance(trace[0], list)
            and isinstance(trace[1], list)):
        return "the trace is not [instructions, decisions]"
    insts, decisions = trace
    if len(insts) > MAX_INSTS:
        return f"the trace has {len(insts)} instructions"
    defined: set[str] = set()
    sampled: set[str] = set()  # expression variables (what a sampling instruction returns)
    for n, inst in enumerate(insts):
        if not (isinstance(inst, list) and len(inst) == 4 and isinstance(inst[0], str)
                and all(isinstance(x, list) for x in inst[1:])):
            return f"instruction {n} is not [kind, inputs, attributes, outputs]"
        kind, inputs, attrs, outputs = inst
        if kind not in KINDS:
            return f"instruction {n} is {kind[:60]!r}, which MetaSchedule's search does not write"
        if not (_plain(inputs) and _plain(attrs) and all(isinstance(o, str) and _NAME.match(o) for o in outputs)):
            return f"instruction {n} ({kind}) has malformed inputs, attributes or outputs"
        problem = _objects_problem(inputs) or _objects_problem(attrs)
        if problem:
            return f"instruction {n} ({kind}) {problem}"
        if kind in ("Annotate", "Unannotate"):
            want_inputs = 2 if kind == "Annotate" else 1
            if not (len(attrs) == 1 and isinstance(attrs[0], str) and len(inputs) == want_inputs):
                return f"instruction {n} ({kind}) is malformed"
            key = attrs[0]
            if key not in ANNOTATIONS:
                return f"{kind} key {key[:80]!r} is not one MetaSchedule's search writes"
            if not (isinstance(inputs[0], str) and inputs[0] in defined):
                return f"instruction {n} ({kind} {key!r}) does not annotate a block or loop of the trace"
            if kind == "Annotate":
                problem = _value_problem(key, inputs[1], sampled)
                if problem:
                    return problem
        defined.update(outputs)
        if kind in SAMPLING:
            sampled.update(outputs)
    decided = set()
    for d in decisions:
        if not (isinstance(d, list) and len(d) == 2 and _is_int(d[0]) and 0 <= d[0] < len(insts)
                and insts[d[0]][0] in SAMPLING and (_is_int(d[1]) or (isinstance(d[1], list)
                                                                       and all(_is_int(x) for x in d[1])))):
            return f"decision {json.dumps(d)[:60]} does not belong to a sampling instruction"
        decided.add(d[0])
    # A traced schedule records every sample it drew; without one, a replay draws anew, so
    # the build (and whether the trace applies at all) would change from run to run.
    undecided = [n for n, inst in enumerate(insts) if inst[0] in SAMPLING and n not in decided]
    if undecided:
        return f"sampling instruction {undecided[0]} has no decision (its replay would be random)"
    return None


def _latency_problem(run_secs) -> str | None:
    if run_secs is None:
        return None  # recorded unmeasured (MetaSchedule writes null)
    if not (isinstance(run_secs, list) and 0 < len(run_secs) <= 10000):
        return "its latencies are not a list of seconds"
    for s in run_secs:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            return f"latency {json.dumps(s)[:40]} is not a number of seconds"
        if not MIN_RUN_SECS <= s <= MAX_RUN_SECS:
            return f"latency {s:g} s is not a plausible measurement"
    return None


def record_problem(record) -> str | None:
    """Why the tuning record (the second element of a record line: [trace, run_secs,
    target, args_info]) must not be applied, or None when it may."""
    if not (isinstance(record, list) and 1 <= len(record) <= 4):
        return "not [trace, latencies, target, arguments]"
    problem = _trace_problem(record[0]) or _latency_problem(record[1] if len(record) > 1 else None)
    if problem:
        return problem
    if len(record) > 2 and not (record[2] is None or (isinstance(record[2], dict)
                                                      and isinstance(record[2].get("kind"), str))):
        return "its target is not a TVM target"
    if len(record) > 3 and not (record[3] is None or isinstance(record[3], list)):
        return "its argument description is not a list"
    return None
