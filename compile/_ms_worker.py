"""Functions MetaSchedule's builder workers run (imported by module path in each worker).

TVM's default_build imports tvm.s_tir.tensor_intrin first, which registers ~500
TVMScript intrinsics through inspect.stack() and costs ~11 s in every fresh worker;
LocalBuilder starts fresh workers for every batch. CPU float schedules use none of
those intrinsics, so CPU builds skip the import.
"""

from __future__ import annotations


def build_cpu(mod, target, _params):
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)
