"""The precision table: what `--precision` can ask for, and what each needs of the target,
resolved in one place beside the target table (compile, verify and bench all come here).

A precision changes what the GEMMs compute in, never the model's interface: inputs and
outputs keep their dtypes (float32 in, float32 out for bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from blockforge.errors import ArgumentError, BlockforgeError

from .resolve import ResolvedTarget


@dataclass(frozen=True)
class Precision:
    name: str
    description: str
    feature: str | None = None  # the LLVM CPU feature the target needs (its mcpu/mattr)
    feature_name: str = ""  # as /proc/cpuinfo and vendors spell it


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "float32 throughout (the model as written)"),
    "bf16": Precision("bf16", "constant-weight matmuls on VDPBF16PS: weights stored bf16, activations rounded "
                              "to bf16 in the kernel, float32 sums; attention products, softmax, LayerNorm and "
                              "residuals stay float32", feature="avx512bf16", feature_name="AVX512_BF16"),
}
DEFAULT = "fp32"


def target_has(target: ResolvedTarget, feature: str) -> bool:
    """The target's code (its mcpu/mattr, not the build machine) may use `feature`."""
    return target.kind == "llvm" and tvm_target_has(target.tvm_target(), feature)


def tvm_target_has(tgt, *features: str) -> bool:
    """A TVM target's code (its mcpu/mattr, not the build machine) may use every one of
    `features`; a target of another architecture answers False (TVM raises for a feature its
    triple does not know)."""
    from tvm.target.codegen import target_has_features

    try:
        return all(bool(target_has_features(f, tgt)) for f in features)
    except Exception:
        return False


def supported_precisions(target: ResolvedTarget) -> list[str]:
    """The precisions `target` can compute in (`blockforge targets` lists them)."""
    return [p.name for p in PRECISIONS.values() if p.feature is None or target_has(target, p.feature)]


def resolve_precision(name: str | None, target: ResolvedTarget) -> Precision:
    """The precision for `target`, or one line saying why not."""
    name = DEFAULT if name is None else name
    if name not in PRECISIONS:
        raise BlockforgeError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}")
    p = PRECISIONS[name]
    if p.feature is not None and not target_has(target, p.feature):
        cpu = target.target_json.get("mcpu", target.kind)
        raise ArgumentError(f"precision {name} needs a CPU target with {p.feature_name}; target {target.name} "
                            f"({cpu}) has none (choose one whose mcpu has it, e.g. znver4 or sapphirerapids, "
                            f"or {{precision}} {DEFAULT})", "precision")
    return p
