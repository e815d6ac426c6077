"""The Relax pipeline as named phases, per target kind, and the build itself.

    [fp32-compute (CPU, float16 models)] -> [int8-combine (as int8-gemm)] -> [fuse-attention (CPU)]
    -> [int8-gemm (CPU with AVX-512 VNNI or aarch64 i8mm / dotprod, quantized models)] -> [bf16-gemm (--precision bf16)]
    -> [conv-gemm (CPU, convolutions)] -> optimize
    -> [fp32-accumulate (GPU, float16 models)] -> [prepack (CPU)] -> legalize -> [apply-tuning] -> schedule -> lower
    -> [dim-bounds (--shape NAME=..MAX)] -> finalize -> codegen

GPU targets must leave no TIR function unscheduled (else "Did you forget to bind?"),
so `schedule` applies dlight's default GPU rules; CPU keeps TVM's default lowering
unless tuning records apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from blockforge import settings
from blockforge.errors import BlockforgeError, error_line
from blockforge.fsutil import atomic_write_text
from blockforge.targets import ResolvedTarget


@dataclass
class BuildResult:
    executable: object = None  # tvm.relax.VMExecutable
    phases: list[str] = field(default_factory=list)
    tasks: int = 0
    untuned_tasks: list[str] = field(default_factory=list)
    weights: list = field(default_factory=list)  # lift_weights: passes.lift_weights.LiftedWeight, in order
    notes: list[str] = field(default_factory=list)  # what the user should hear (compile prints them as warnings)


# What a build can leave out, to A/B one rewrite inside a whole model (benchmarks/ use these;
# tune and the CLI never do): name -> what it turns off.
ABLATIONS = {
    "fuse-attention": "the fused CPU attention kernel (phase fuse-attention)",
    "fp32-compute": "CPU float16 models computed in float32 (left out: float16 storage, float32 sums)",
    "patch-conv": "patch-embedding convolutions as im2col + matmul (fast_math)",
    "conv-gemm": "conv1d/conv2d as im2col + packed GEMM with fused epilogue (phase conv-gemm, compile/conv)",
    "conv-panels": "1-D conv outputs kept in whole GEMM panels through bias/activation, cropped after them "
                   "(left out: cropped in the GEMM's tile, which made that epilogue scalar)",
    "conv-implicit": "stride-1 1-D convs as a GEMM reading the padded input (left out: im2col columns)",
    "conv-strided-loads": "strided 1-D convs' im2col columns, and 2-D convs' of output rows at least a vector "
                          "wide, by contiguous vector loads (and a lane shuffle at a stride) (compile/conv/strided.py; "
                          "left out: the gather TVM scalarises)",
    "conv-narrow-rows": "2-D convs whose output rows are narrower than a vector (ResNet's 14 x 14 and 7 x 7), or "
                        "strided rows of no whole vectors (its 56 -> 28 stride-2 3x3): their im2col columns row by "
                        "row, (oh, ow) loops per (channel, tap) (compile/conv/strided.py im2col_narrow; left out: "
                        "the gather, a divmod per element, or im2col_2d's vectors straddling rows)",
    "conv-rows": "1x1 unpadded one-group convs whose output positions fill under 90% of the GEMM's 64-wide "
                 "column panels (ResNet's 7 x 7 and 14 x 14 stages: 77%) as the transposed GEMM, positions in 6-row "
                 "tiles read from x in place at the stride, output channels as the panels, written back transposed "
                 "(compile/conv/rewrite.py conv_gemm_rows; left out: positions as the panels' columns)",
    "conv-wide": "stride-1 2-D convs (ResNet's 3x3s) as an implicit GEMM over the padded image: positions "
                 "j = oh * Wp + ow over the padded width Wp, so each (channel, tap) reads one contiguous run of the "
                 "flat padded image in place (its start from a table), the Wp - OW extra positions per row dropped "
                 "after the epilogue (compile/conv/rewrite.py conv_gemm_wide; left out: K x L im2col columns)",
    "conv-depthwise": "depthwise convs (one channel per group) on a direct kernel: a padded plane per channel, "
                      "whole vectors of a row over the taps, the epilogue per row (compile/conv/depthwise.py; "
                      "left out: TVM's conv2d, a serial scalar loop nest)",
    "conv-channels-last": "a depthwise conv between token layouts (tokens -> image -> conv -> tokens: SegFormer's "
                          "Mix-FFN) on a channels-last kernel reading and writing the tokens (compile/conv/depthwise.py; "
                          "left out: the NCHW depthwise kernel and a transpose each side)",
    "conv-pointwise": "1x1 conv2d as a 1-D conv over the H*W positions (the GEMM reads NCHW in place) and the "
                      "elementwise consumers of each 2-D conv's GEMM (bias, BN, activation) moved before its 4-D "
                      "reshape into the GEMM's epilogue (left out: 1x1 convs as patch convs, transposed to tokens and "
                      "back; the epilogue a kernel of its own)",
    "conv-trim-taps": "kernel taps that read only padding for every output dropped before the conv's GEMM",
    "panel-prefetch": "the CPU matmul's micro-tile prefetching the next weight panel, a line per k step, in GEMMs "
                      "of 19-64 static rows (BLOCKFORGE_PANEL_PREFETCH: all of them, or off) "
                      "(compile/passes/panel_prefetch.py; left out: the hardware prefetcher alone)",
    "row-tiles": "packed matmuls whose static M no row tile divides (ViT's 197) computed over whole tiles and "
                 "cropped (left out: the last tile's row guard in every tile's k loop)",
    "attention-qtile": "the fused attention kernel's query tiles balanced at a static Sq no tile divides (ViT's "
                       "197: 4 tiles of 50) (left out: the recorded or default tile)",
    "attention-key-tail": "the fused attention kernel's last key tile at a static Skv no key tile divides only the "
                          "remainder's vectors wide (ViT's 197: 16 keys) (left out: a whole 64-key tile, 59 dropped)",
    "attention-exp2": "the fused attention kernel's softmax exps as 2^t of t = (s - m) log2 e (flash.fast_exp2: 7 "
                      "multiply/FMA operations a vector) (left out: flash.fast_exp's Cody-Waite polynomial, 10)",
    "ragged-n": "the CPU matmul rule for an N no panel width divides (ViT's 197 tokens)",
    "matvec": "the CPU rule for packed matmuls of <= 4 rows, where BLOCKFORGE_MATVEC=1 turns it on (left out: CPUMatmul's 6-row tile)",
    "pad-panels": "constant weights whose N no panel width divides padded to whole panels and cropped "
                  "(left out: such matmuls stay unpacked)",
    "int8-gemm": "quantized matmuls (MatMulInteger, QDQ) on the int8 kernel (VNNI, SMMLA, SDOT) (left out: TVM's int32 "
                 "GEMM loops, or dequantize + float32 GEMM for QDQ)",
    "attention-heads": "self-attention's per-head projections, one combined GEMM split into 3h items, regrouped "
                       "into a GEMM per role in the heads' order, so fuse-attention merges the heads into one call "
                       "(compile/attention/heads.py; left out: an attention call and a K^T transpose per head, the "
                       "split and the concat of the heads)",
    "int8-combine": "parallel int8 projections of one quantized activation (ORT dynamic quantization's per-head "
                    "MatMulIntegers) as one int8 GEMM and a split, before fuse-attention (compile/quant/combine.py; "
                    "left out: a GEMM, an attention call and a K^T transpose per head, and a concat of the heads)",
    "int8-qdq-epilogue": "a QDQ model's requantize / bias / gelu chain after an int8 GEMM computed in the "
                         "kernel's epilogue, writing the next GEMM's int8 input (compile/quant/gemm.py POST_STEPS; "
                         "left out: the GEMM writes float32 and a second kernel re-quantizes it)",
    "concat-stack": "a concat along the last axis of equal parts (a QDQ MHA's heads, rotate_half) as a stack on "
                    "a new axis and a reshape, so the vectorised kernel reads whole vectors (compile/passes/"
                    "concat_stack.py; left out: masked gathers per element)",
    "int8-lut-tail": "a QDQ epilogue's gelu and quantize after its last requantize read from a 256-byte table "
                     "of the levels with VPERMI2B (AVX512_VBMI targets; compile/quant/gemm.py lut_tail; left out: "
                     "gelu and the quantize's division per element)",
    "int8-attention": "a QDQ model's attention products (MatMul of two dequantized runtime tensors: Q K^T, "
                      "P V) on the int8 kernel, the second operand packed in the graph each call "
                      "(compile/quant/rewrite.py match_dequantized; left out: dequantize + float32 GEMM)",
    "int8-sums": "the zero-point row and column sums of an int8 GEMM with a runtime operand (the attention "
                 "products) on parallel vectorised kernels (compile/quant/sums.py; left out: TVM's reductions)",
    "int8-batched-products": "a batched-heads export's attention products ((1, h, S, d) x (1, h, d, S), HF SDPA) "
                             "as one batched int8 kernel each (left out: dequantize + float32 batched matmul)",
    "int8-addend": "an add after an int8 GEMM of a tensor of its output's rows (Hugging Face's (1, 1, S, S) "
                   "attention mask after Q K^T, a residual) read in the kernel's epilogue (left out: a pass over "
                   "the float32 output)",
    "int8-gelu-ops": "gelu spelled out in ops (x * 0.5 * (1 + erf(x / sqrt 2)): Hugging Face BERT) after an int8 "
                     "GEMM taken into its epilogue as one gelu step (left out: a kernel of its own)",
    "int8-shift-quantize": "an attention product's activations quantized straight into the instruction's "
                           "signedness (zero point +-128; left out: an s8 <-> u8 pass over the bytes)",
    "int8-gelu-segments": "an int8 epilogue's gelu per element in 32 cubic segments read with VPERMI2PS (AVX-512 "
                          "targets; compile/quant/gelu.py; left out: fast_erf's rational gelu, a VDIVPS per 16 "
                          "outputs)",
    "int8-i8mm": "int8 GEMMs on an +i8mm target (Armv8.6: Neoverse N2/V1, Cortex-A710) on SMMLA, 2 x 8 by "
                 "8 x 2 per instruction (compile/quant/gemm.py mmla; left out: SDOT, 4 x 4)",
    "int8-stack-tiles": "the untuned int8 VNNI GEMM's micro-tile sized so its accumulators (5 x 3 vectors, 960 B) "
                        "are a stack alloca (compile/quant/gemm.py STACK_BYTES; left out: the 6 x 4 tile, 1536 B, "
                        "a workspace alloc/free per row tile)",
    "stack-allocs": "kernel-local buffers up to 64 KiB (a GEMM's accumulator tile) as stack allocas, not TVM's "
                    "workspace allocator called per tile (compile/passes/stack_allocs.py; left out: TVM's 1 KiB rule)",
    "window-allocs": "a kernel-local buffer of symbolic size (a GEMM's accumulator over seq rows) shrunk to the "
                     "constant window one row tile uses, so the stack pass takes it (compile/passes/window_allocs.py; "
                     "left out: a (seq, 64) workspace buffer)",
    "window-partitioned": "window-allocs also where LoopPartition split a buffer's row tiles into a main loop and "
                          "a guarded tail: the main loop's window (a cropped GEMM's write-back, GPT-2's LM head: "
                          "straight from the accumulators to the output); left out: the (seq, 64) buffer for both",
    "bf16-gemm": "--precision bf16's matmuls on the VDPBF16PS kernel (left out: the float32 build)",
    "bf16-row-fit": "a bf16 GEMM whose static M is a multiple of 4 but not of 6 (BERT's 128, 512) in 4-row x "
                    "6-vector micro-tiles (left out: 6 x 4, the last row tile partly clamped rows)",
    "bf16-gelu-segments": "the bf16 GEMM's gelu in 32 cubic segments read with VPERMI2PS (compile/quant/gelu.py; "
                          "left out: fast_erf's rational gelu, a VDIVPS per 16 outputs)",
    "bf16-attention": "--precision bf16's fused attention with Q K^T and P V on VDPBF16PS, softmax and sums float32 "
                      "(compile/attention/flash.py; left out: the float32 attention kernel)",
    "attention-gqa-rows": "a grouped-query decode step's fused attention one job per kv head, the group's query "
                          "heads as its rows: each cached K/V row loaded once for them (compile/attention/flash.py "
                          "group_rows; left out: one job per query head)",
    "attention-short-tile": "an Sq below one query tile balanced as a longer one is (Wav2Vec2's 49 rows as 50: 5-row "
                            "micro-kernels and a clamped row; compile/attention/flash.py query_tile; left out: Sq rows "
                            "as they are, 1-row micro-kernels where Sq has no divisor from 2 to 6)",
    "attention-key-rows": "at seq 1 the fused attention reads K as the cache holds it (left out: the graph's "
                          "per-step transpose to K^T)",
    "nan-guard": "SDPA's where(isnan(softmax), c, softmax) as where(softmax >= 0, softmax, c), the same values "
                 "(compile/passes/nan_guard.py; left out: TVM's select on isnan, scalarised in front of an 8-bit "
                 "quantize)",
    "fast-sigmoid": "sigmoid as 1 / (1 + fast_exp(-x)) (fast_math; left out: TIR's sigmoid, a libm expf per element)",
    "matmul-reshape": "reshape(matmul(reshape(x, [M, K]), W), [*L, N]) as matmul(x, W), so the epilogue fuses "
                      "(compile/passes/matmul_reshape.py; left out: bias/activation/residual as separate passes)",
    "rms-norm": "exported RMSNorm (x * 1/sqrt(mean(x**2) + eps) * w) as one rms_norm row kernel "
                "(compile/passes/norms.py; left out: a square kernel and an unscheduled mean kernel)",
    "instance-norm": "InstanceNormalization's mean/variance/normalize (Wav2Vec2's GroupNorm) as one row kernel "
                     "reading a conv's GEMM panels (compile/passes/norms.py; left out: a crop, a variance and a "
                     "normalize kernel)",
    "split-affine": "a combined projection's per-part bias add and scalar scale after its split (Whisper's q/v "
                    "biases, the query's d**-0.5) folded into the projection's weights and one bias "
                    "(compile/passes/split_affine.py; left out: an elementwise kernel per part after the split)",
    "transpose-tiles": "an elementwise kernel that reads an input across its lines (a transpose, through reshapes: "
                       "MobileViT's unfold) in tiles of 16 rows x a vector (compile/schedule/elementwise.py; left "
                       "out: rows parallel, the row vectorised, a line fetched per element)",
    "elementwise": "a kernel of elementwise steps only (a residual add of symbolic rows) inlined, rows parallel, "
                   "the row vectorised (compile/schedule/elementwise.py; left out: float modules leave it to "
                   "TVM's serial scalar loop, int8 modules still schedule theirs)",
    "qkv-heads": "the combined QKV projection's split, head transposes and RoPE as one row kernel "
                 "(compile/passes/qkv_heads.py; left out: a split copy and a scalar kernel per part)",
    "reciprocal": "divisions by a constant as products with its reciprocal: the softmax normalised by 1 / its row "
                  "sum, quantizes with a constant per-tensor scale (compile/passes/fast_math.py) and the int8 QDQ "
                  "epilogue's (compile/quant/gemm.py Epilogue) as x times 1 / scale, as ORT's fused QDQ kernels and "
                  "OpenVINO do; left out: a division per element, bit-exact with the unfused build (vdivps, "
                  "Zen 4's slowest op)",
    "output-views": "a model output that reshapes an opaque kernel's result (the int8 GEMM's rows back to "
                    "(B, S, N)) as a view of it (compile/passes/output_views.py; left out: a copy kernel)",
}


def _check_ablations(without) -> frozenset[str]:
    unknown = set(without) - set(ABLATIONS)
    if unknown:
        raise ValueError(f"unknown ablation(s) {sorted(unknown)}: known {sorted(ABLATIONS)}")
    return frozenset(without)


@dataclass
class Phase:
    name: str
    passes: Callable[[], list]


def _prepack(target: ResolvedTarget, without: frozenset[str]) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.schedule.matmul import panel_width
        from blockforge.compile.passes.prepack import prepack_pass

        from blockforge.compile.schedule.base import MR

        return [prepack_pass(panel_width(target.tvm_target()), pad="pad-panels" not in without,
                             mr=None if "row-tiles" in without else MR)]
    return passes


def _conv_gemm(target: ResolvedTarget, without: frozenset[str]) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.conv.rewrite import conv_gemm_pass
        from blockforge.compile.schedule.base import vector_lanes
        from blockforge.compile.schedule.matmul import panel_width

        # Before optimize: the activations are still relax ops its crops slide past (fast_math
        # makes them call_tir); the patch convs are left to fast_math's patch-conv rewrite.
        tgt = target.tvm_target()
        return [conv_gemm_pass(panel_width(tgt), panels="conv-panels" not in without,
                               implicit_gemm="conv-implicit" not in without, lanes=vector_lanes(tgt),
                               trim="conv-trim-taps" not in without,
                               strided_loads="conv-strided-loads" not in without,
                               depthwise="conv-depthwise" not in without,
                               pointwise="conv-pointwise" not in without,
                               channels_last="conv-channels-last" not in without,
                               narrow="conv-narrow-rows" not in without,
                               rows="conv-rows" not in without, wide="conv-wide" not in without)]
    return passes


def _fuse_attention(target: ResolvedTarget, database, without: frozenset[str] = frozenset(),
                    bf16: bool = False) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.attention.fuse import fuse_attention

        from blockforge.compile.attention.heads import regroup_heads

        # Before optimize: fast_math turns softmax into a call_tir the matcher
        # would no longer see. Tile choices come from the database's records.
        regroup = [] if "attention-heads" in without else [regroup_heads()]
        return regroup + [fuse_attention(target.tvm_target(), database, balance="attention-qtile" not in without,
                               key_rows="attention-key-rows" not in without, key_tail="attention-key-tail" not in without,
                               exp2="attention-exp2" not in without, bf16=bf16,
                               gqa_rows="attention-gqa-rows" not in without,
                               short_tile="attention-short-tile" not in without)]
    return passes


def target_int8_isa(target: ResolvedTarget) -> str | None:
    """The target's int8 dot-product instruction (AVX-512 VNNI, aarch64 SMMLA or SDOT), or None."""
    from blockforge.compile.quant.isa import for_target

    isa = for_target(target.tvm_target())
    return isa.name if isa is not None else None


def _int8_gemm(isa: str, target: ResolvedTarget, database, without: frozenset) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.quant.gemm import epilogue_for
        from blockforge.compile.quant.rewrite import int8_gemm

        # Before optimize: its fast_math turns gelu into a call_tir the epilogue matcher would
        # no longer see (as fuse-attention, for softmax); the int32 matmul is still one op.
        # The database: tuned tiles per kernel (compile/quant/tiles.py).
        tvm_target = target.tvm_target()
        epilogue = epilogue_for(tvm_target, lut="int8-lut-tail" not in without,
                                reciprocal="reciprocal" not in without,
                                gelu_segments="int8-gelu-segments" not in without)
        return [int8_gemm(isa, tvm_target, database, post="int8-qdq-epilogue" not in without,
                          stack="int8-stack-tiles" not in without, epilogue=epilogue,
                          products="int8-attention" not in without, sums_kernels="int8-sums" not in without,
                          shift_quantize="int8-shift-quantize" not in without,
                          batched_products="int8-batched-products" not in without,
                          addends="int8-addend" not in without, gelu_ops="int8-gelu-ops" not in without)]
    return passes


def _int8_combine() -> list:
    from blockforge.compile.quant.combine import int8_combine

    return [int8_combine()]


def _bf16_gemm(target: ResolvedTarget, database, without: frozenset[str]) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.bf16.rewrite import bf16_gemm

        # Before optimize, as int8-gemm: gelu is still one op the epilogue can take. The
        # database: tuned tiles per kernel (compile/bf16/tiles.py).
        return [bf16_gemm(row_fit="bf16-row-fit" not in without, gelu_segments="bf16-gelu-segments" not in without,
                          target=target.tvm_target(), database=database)]
    return passes


def _optimize(without: frozenset[str], cpu_target: ResolvedTarget | None = None) -> Callable[[], list]:
    def passes() -> list:
        from tvm import relax

        from blockforge.compile.passes.fast_math import fast_math
        from blockforge.compile.passes.norms import instance_norm_pass, rms_norm_pass

        # (Parallel per-head matmuls were already combined at import: frontend.embed_weights.)
        # rms_norm before fast_math: it matches x ** 2 as the power op.
        from blockforge.compile.passes.matmul_reshape import matmul_reshape_pass

        norms = [] if "rms-norm" in without else [rms_norm_pass()]
        norms += [] if "instance-norm" in without else [instance_norm_pass()]
        norms += [] if "matmul-reshape" in without else [matmul_reshape_pass()]
        if "split-affine" not in without:  # before qkv_heads: it takes layout-only parts
            from blockforge.compile.passes.split_affine import split_affine_pass

            norms.append(split_affine_pass())
        if cpu_target is not None and "qkv-heads" not in without:  # a CPU kernel (T.parallel)
            from blockforge.compile.passes.qkv_heads import qkv_heads_pass
            from blockforge.compile.schedule.base import vector_lanes

            norms.append(qkv_heads_pass(vector_lanes(cpu_target.tvm_target())))
        if cpu_target is not None and "concat-stack" not in without:  # (a CPU vectorisation matter)
            from blockforge.compile.passes.concat_stack import concat_stack_pass

            norms.append(concat_stack_pass())
        if "nan-guard" not in without:  # before fast_math: the softmax is still relax.nn.softmax
            from blockforge.compile.passes.nan_guard import nan_guard_pass

            norms.append(nan_guard_pass())
        return [relax.transform.DecomposeOpsForInference(), relax.transform.CanonicalizeBindings(), *norms,
                fast_math(patch_conv="patch-conv" not in without, sigmoid="fast-sigmoid" not in without,
                          reciprocal="reciprocal" not in without),
                relax.transform.FoldConstant()]
    return passes


def tvm_backend(target: ResolvedTarget):
    """TVM's own Relax backend pipeline module for the target kind: its pass lists are used as
    they are (not copied), so a TVM upgrade that changes them reaches our builds too."""
    import importlib

    kind = "cpu_generic" if not target.is_gpu else "cuda" if target.kind == "cuda" else "gpu_generic"
    # the .pipeline module: cpu_generic's package does not re-export dataflow_lower_passes
    return importlib.import_module(f"tvm.relax.backend.{kind}.pipeline")


def _legalize(target: ResolvedTarget) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.passes.zero_division import ieee_division

        tgt, backend = target.tvm_target(), tvm_backend(target)
        # TVM's GPU lists end in dlight's ApplyDefaultSchedule: ours is the `schedule` phase,
        # after apply-tuning (records must win over default rules), so it is taken out here.
        # The dispatch passes first: sort/scan/sampling ops have no LegalizeOps rule (RoBERTa's
        # position ids are a cumsum of the mask).
        legalize = [p for p in backend.legalize_passes(tgt) if p.info.name != "ApplyDefaultSchedule"]
        # before FuseOps: kernels writing only dims' values stay unfused (passes/symbolic_dims.py)
        at = next((i + 1 for i, p in enumerate(legalize) if p.info.name == "AnnotateTIROpPattern"), None)
        if at is not None:
            from blockforge.compile.passes.symbolic_dims import opaque_scalar_kernels

            legalize.insert(at, opaque_scalar_kernels())
        return [*backend.library_dispatch_passes(tgt), *legalize,
                ieee_division]  # before any TIR simplification can fold a 0.0 / 0.0 into an error
    return passes


def default_rules(target: ResolvedTarget, without: frozenset[str] = frozenset(), int8: bool = False) -> list:
    """The schedule rules an untuned build applies (and tune seeds each task with), in order.
    int8: a module the int8-gemm phase rewrote; its elementwise chains get CPUElementwise."""
    from tvm.s_tir import dlight as dl

    if target.is_gpu:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    from blockforge.compile.schedule.elementwise import CPUElementwise
    from blockforge.compile.schedule.matvec import CPUMatvec
    from blockforge.compile.schedule.ragged import CPUMatmulRaggedN
    from blockforge.compile.schedule.rules import default_cpu_rules

    from blockforge.compile.conv.schedule import CPUDepthwise, CPUDepthwiseTokens, CPUIm2col

    from blockforge.compile.schedule.matmul import CPUMatmul

    rules = [r for r in default_cpu_rules() if not ("ragged-n" in without and isinstance(r, CPUMatmulRaggedN))
             and not (isinstance(r, CPUMatvec) and ("matvec" in without or not settings.matvec()))]
    mode = "off" if "panel-prefetch" in without else settings.panel_prefetch()
    if mode != "few-rows":
        rules = [CPUMatmul(prefetch=mode == "all", rows=None) if isinstance(r, CPUMatmul) else r for r in rules]
    # CPUIm2col before CPUElementwise: an im2col kernel is elementwise too, and wants its own;
    # CPUDepthwise first: its conv is a reduction CPURowReduction would take
    return (([] if "conv-depthwise" in without else [CPUDepthwise(), CPUDepthwiseTokens()]) + rules
            + ([] if "conv-gemm" in without else [CPUIm2col()])
            + ([CPUElementwise(tile_transposes="transpose-tiles" not in without)]
               if int8 or "elementwise" not in without else []))


def _schedule(target: ResolvedTarget, without: frozenset[str], int8: bool) -> Callable[[], list]:
    def passes() -> list:
        from tvm.s_tir import dlight as dl

        if target.is_gpu:
            # dlight's GPU Matmul imports tvm.s_tir.tensor_intrin on first apply: ~250 TVMScript
            # parses, each calling inspect.stack(); the shallow import took a 64-wide FFN's Metal
            # build from >600 s (loaded machine; 134 s in the clean-clone CI) to (see intrinsics.py).
            from blockforge.compile.schedule.intrinsics import import_tensor_intrinsics

            import_tensor_intrinsics()
        from blockforge.compile.passes.panel_prefetch import panel_prefetch

        return [dl.ApplyDefaultSchedule(*default_rules(target, without, int8)),
                *([] if target.is_gpu else
                  [panel_prefetch("panel-prefetch" not in without and settings.panel_prefetch() != "off")])]
    return passes


def _lower(target: ResolvedTarget, without: frozenset[str] = frozenset()) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.passes.zero_division import ieee_division

        # ieee_division again: scheduling (compute_inline) and tuning records join expressions
        # across blocks
        from blockforge.compile.passes.output_views import output_reshape_views
        from blockforge.compile.passes.symbolic_dims import guarded_reshape_views

        views = [] if "output-views" in without else [output_reshape_views()]
        lower = tvm_backend(target).dataflow_lower_passes(target.tvm_target())
        return [ieee_division, *(q for p in lower for q in ([*views, guarded_reshape_views(p)]
                                                            if p.info.name == "RewriteDataflowReshape" else [p]))]
    return passes


def _finalize(target: ResolvedTarget) -> Callable[[], list]:
    return lambda: tvm_backend(target).finalize_passes(target.tvm_target())


def _fp32_accumulate() -> list:
    from tvm import relax

    # float16 GEMMs accumulating in float16 lose ~sqrt(K) ulps (4e-2 abs at K=3072);
    # ONNX Runtime accumulates in float32, and so do we: fp16 in/out, fp32 sums.
    return [relax.transform.ToMixedPrecision(out_dtype="float32")]


def _fp32_compute() -> list:
    from blockforge.compile.passes.fast_math import fast_math
    from blockforge.compile.passes.fp32_compute import float16_as_float32

    # CPU: ONNX Runtime's CPU provider computes float16 graphs in float32 (casts at the
    # inputs and outputs only); float16 intermediates overflowed where its stay finite
    # (MHA inputs x300: 1024 of 1024 outputs NaN vs 0). fp32_compute.py has the numbers.
    # The activations converted to float32 then get the fast kernels float32 models get.
    return [float16_as_float32, fast_math()]


def has_fp16(mod) -> bool:
    from tvm import relax

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for p in func.params:
                if str(getattr(p.ty, "dtype", "")) == "float16":
                    return True
    return False


def _has_call(mod, pred) -> bool:
    """Whether any call in the module's Relax functions satisfies pred."""
    from tvm import relax

    found = []

    def visit(e):
        if isinstance(e, relax.Call) and pred(e):
            found.append(e)

    for func in mod.functions.values():
        if isinstance(func, relax.Function) and not found:
            relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


def has_int8_matmul(mod) -> bool:
    """A matmul computed in int32 (TVM's import of MatMulInteger): a quantized model."""
    return _has_call(mod, lambda e: getattr(e.op, "name", None) == "relax.matmul"
                     and str(getattr(e.ty, "dtype", "")) == "int32")


def has_conv(mod) -> bool:
    """A conv1d/conv2d (the conv-gemm phase's work)."""
    return _has_call(mod, lambda e: getattr(e.op, "name", None) in ("relax.nn.conv1d", "relax.nn.conv2d"))


def phases(target: ResolvedTarget, database=None, fp16: bool = False, default_schedules: bool = True,
           fuse_attention: bool | None = None, without=frozenset(), int8: bool = False,
           precision: str = "fp32", conv: bool = False, lift: list | None = None,
           kv_inplace: bool = False, dim_bounds: dict | None = None) -> list[Phase]:
    """fuse_attention: None follows the setting (BLOCKFORGE_FUSE_ATTENTION); benchmarks pass
    False/True to A/B both builds in one process. without: names from ABLATIONS to leave out.
    int8: the module has integer matmuls (a quantized model): only then the int8-gemm phase,
    so float models keep their phase list (manifests, dumps) as before. precision: resolved
    against the target by targets.precision (bf16: the bf16-gemm phase). conv: the module has
    conv1d/conv2d ops (has_conv): only then the conv-gemm phase, for the same reason. lift: a list
    to collect the weights the lift-weights phase takes out of the executable (compile's
    artifacts: weights.bin); None: no such phase. kv_inplace: the module has an entry marked for
    the preallocated cache (compile/decode/inplace.py, `compile --kv-capacity`): the kv-inplace
    phase after fuse-attention (CPU only). dim_bounds: upper bounds of symbolic dims (`--shape
    seq=..1024`): the dim-bounds phase before finalize (memory planned at the bound, checked in
    the module: compile/passes/dim_bounds.py)."""
    out = []
    without = _check_ablations(without)
    fuse = (settings.fuse_attention() if fuse_attention is None else fuse_attention) and "fuse-attention" not in without
    cpu = target.kind == "llvm"
    if fp16 and cpu and "fp32-compute" in without:
        out.append(Phase("fp32-accumulate", _fp32_accumulate))  # the float16-storage scheme, for A/B
    elif fp16 and cpu:
        # CPUs compute float16 models in float32 as ORT's CPU provider does, first: the fused
        # attention kernel then computes in float32 too (fused in float16, its scores
        # overflowed where ORT's stay finite: tests/robustness/test_fp16_overflow.py).
        out.append(Phase("fp32-compute", _fp32_compute))
    isa = target_int8_isa(target) if int8 and cpu and default_schedules and "int8-gemm" not in without else None
    if isa == "i8mm" and "int8-i8mm" in without:
        isa = "sdot"  # (every +i8mm CPU has the dot product: compile/quant/arm.py has_i8mm)
    if isa is not None and "int8-combine" not in without:
        # before fuse-attention: the per-head attentions then read an even split it can merge
        out.append(Phase("int8-combine", _int8_combine))
    if cpu and default_schedules and fuse:
        # --precision bf16: the attention products on VDPBF16PS too (resolve_precision has
        # checked the target has AVX512_BF16)
        bf16 = precision == "bf16" and "bf16-attention" not in without
        out.append(Phase("fuse-attention", _fuse_attention(target, database, without, bf16)))
    if kv_inplace and cpu:
        out.append(Phase("kv-inplace", _kv_inplace))
    if isa is not None:
        out.append(Phase("int8-gemm", _int8_gemm(isa, target, database, without)))
    if precision == "bf16" and cpu and default_schedules and "bf16-gemm" not in without:
        out.append(Phase("bf16-gemm", _bf16_gemm(target, database, without)))
    if cpu and default_schedules and "conv-gemm" not in without and conv:
        out.append(Phase("conv-gemm", _conv_gemm(target, without)))
    out.append(Phase("optimize", _optimize(without, target if cpu and default_schedules else None)))
    if fp16 and not cpu:
        # GPUs keep float16 storage (ORT's CUDA provider has float16 kernels), fp32 sums.
        out.append(Phase("fp32-accumulate", _fp32_accumulate))
    if target.kind == "llvm" and default_schedules and settings.prepack():
        out.append(Phase("prepack", _prepack(target, without)))
    out.append(Phase("legalize", _legalize(target)))
    if database is not None:
        def apply() -> list:
            from tvm import relax

            return [relax.transform.MetaScheduleApplyDatabase(enable_warning=False)]
        out.append(Phase("apply-tuning", apply))
    if target.is_gpu or (target.kind == "llvm" and default_schedules):
        int8_gemm = any(p.name in ("int8-gemm", "bf16-gemm") for p in out)  # their epilogues' chains
        out.append(Phase("schedule", _schedule(target, without, int8_gemm)))
    if lift is not None:  # after every pass that changes constants; before lower's shape checks
        out.append(Phase("lift-weights", _lift_weights(lift)))
    out.append(Phase("lower", _lower(target, without)))
    if dim_bounds:
        out.append(Phase("dim-bounds", _dim_bounds(dim_bounds)))
    out.append(Phase("finalize", _finalize(target)))
    return out


def _dim_bounds(bounds: dict) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.passes.dim_bounds import bound_dims

        return [bound_dims(bounds)]
    return passes


def _kv_inplace() -> list:
    from blockforge.compile.decode.inplace import kv_inplace_pass

    return [kv_inplace_pass()]


def has_inplace_entry(mod) -> bool:
    from tvm import relax

    from blockforge.compile.decode.inplace import CAP_ATTR

    return any(isinstance(f, relax.Function) and f.attrs is not None and CAP_ATTR in f.attrs
               for _, f in mod.functions_items())


def _lift_weights(collect: list) -> Callable[[], list]:
    def passes() -> list:
        from blockforge.compile.passes.lift_weights import lift_weights_pass

        return [lift_weights_pass(collect)]
    return passes


def run_phases(mod, target: ResolvedTarget, *, database=None, dump_ir: Path | None = None,
               stop_after: str | None = None, report: BuildResult | None = None,
               default_schedules: bool = True, fuse_attention: bool | None = None, without=frozenset(),
               precision: str = "fp32", lift_weights: bool = False, dim_bounds: dict | None = None):
    """Run the phases in order (optionally stopping after one); returns (mod, phase names).
    lift_weights: the lift-weights phase runs, collecting into report.weights. dim_bounds:
    symbolic dim name -> upper bound (phases())."""
    import tvm

    from blockforge.compile.passes.zero_division import check_integer_division

    tgt = target.tvm_target()
    names = []
    if dump_ir:
        dump_ir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(dump_ir / "00-import.py", mod.script(show_meta=False))
    with tgt, tvm.transform.PassContext(opt_level=3):
        for i, phase in enumerate(phases(target, database, has_fp16(mod), default_schedules, fuse_attention, without,
                                         has_int8_matmul(mod), precision, has_conv(mod),
                                         lift=(report.weights if report is not None else []) if lift_weights
                                         else None, kv_inplace=has_inplace_entry(mod), dim_bounds=dim_bounds),
                                  start=1):
            if phase.name == "apply-tuning":
                if report is not None:
                    report.tasks, report.untuned_tasks = tuning_coverage(mod, target, database)
                with database:
                    mod = tvm.transform.Sequential(phase.passes())(mod)
            else:
                mod = tvm.transform.Sequential(phase.passes())(mod)
            check_integer_division(mod)
            names.append(phase.name)
            if dump_ir:
                atomic_write_text(dump_ir / f"{i:02d}-{phase.name}.py", mod.script(show_meta=False))
            if phase.name == stop_after:
                break
    return mod, names


def extract_tasks(mod, target: ResolvedTarget) -> list:
    """MetaSchedule tasks of a legalized, fused module. The fused attention kernels are not
    among them: hand-written loop nests, not a search space; tune times their tiles instead.
    Nor are the int8 GEMM and range kernels (compile/quant): tune times the GEMM's tiles instead."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.attention.flash import is_kernel
    from blockforge.compile.bf16 import gemm as bf16_gemm
    from blockforge.compile.quant import gemm, minmax

    from blockforge.compile.passes import qkv_heads

    def hand_written(f) -> bool:
        return (is_kernel(f) or qkv_heads.is_kernel(f) or gemm.is_kernel(f) or minmax.is_kernel(f)
                or bf16_gemm.is_kernel(f))

    return [t for t in ms.relax_integration.extract_tasks(mod, target.tvm_target())
            if not hand_written(t.dispatched[0]["main"])]


def tuning_coverage(mod, target: ResolvedTarget, database) -> tuple[int, list[str]]:
    """(number of tasks, names of tasks the database has no record for); each fused
    attention kernel counts as a task, covered when its tile choice is recorded."""
    from blockforge.compile.attention.fuse import kernel_specs
    from blockforge.compile.attention.tiles import workload
    from blockforge.compile.schedule.base import vector_lanes

    tasks = extract_tasks(mod, target)
    missing = [t.task_name for t in tasks if not database.has_workload(t.dispatched[0])]
    specs = kernel_specs(mod)
    lanes = vector_lanes(target.tvm_target())
    missing += [f"fused_attention ({s.describe()})" for s in specs if not database.has_workload(workload(s, lanes))]
    return len(tasks) + len(specs), missing


def build(mod, target: ResolvedTarget, *, database=None, dump_ir: Path | None = None,
          default_schedules: bool = True, fuse_attention: bool | None = None, without=frozenset(),
          precision: str = "fp32", lift_weights: bool = False, dim_bounds: dict | None = None) -> BuildResult:
    """Relax IRModule -> VM executable for `target` (whether it can build here is the
    caller's check: compile.session.open_model).

    default_schedules=False keeps TVM's own CPU lowering (naive loops): the baseline
    blockforge's schedules and tuning are measured against; `without` leaves out named
    rewrites (ABLATIONS) to A/B each inside a whole model. lift_weights: the large constants
    become trailing parameters of main (result.weights), for an artifact's weights.bin.
    dim_bounds: upper bounds of symbolic dims (the memory plan's sizes; checked in the module)."""
    import tvm

    result = BuildResult()
    mod, result.phases = run_phases(mod, target, database=database, dump_ir=dump_ir, report=result,
                                    default_schedules=default_schedules, fuse_attention=fuse_attention,
                                    without=without, precision=precision, lift_weights=lift_weights,
                                    dim_bounds=dim_bounds)
    try:
        tir = "default"
        if target.kind == "llvm" and default_schedules and "stack-allocs" not in without:
            from blockforge.compile.passes.stack_allocs import tir_pipeline

            tir = tir_pipeline(window="window-allocs" not in without, partitioned="window-partitioned" not in without)
        ex = tvm.compile(mod, target=target.tvm_target(), relax_pipeline=None, tir_pipeline=tir)
    except Exception as e:
        raise BlockforgeError(f"TVM build for {target.name} failed: {error_line(e, last=True, limit=400)}") from None
    result.executable = ex
    return result
