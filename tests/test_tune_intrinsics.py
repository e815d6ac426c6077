"""compile.schedule.intrinsics: TVM's tensor intrinsics imported with a shallow inspect.stack(), which
TVM's TVMScript parser cannot tell from the real one (the same frames, the same source lines
where it reads them), so every PrimFunc parses the same."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from blockforge.compile.schedule.intrinsics import shallow_stack, shallow_stacks


def _both():
    return inspect.stack(), shallow_stack()


def _nested(depth: int):
    return _nested(depth - 1) if depth else _both()


def test_shallow_stack_is_inspect_stack_where_tvm_reads_it():
    real, shallow = _nested(4)  # both start at _both's frame, on the same line
    assert [f.frame for f in shallow] == [f.frame for f in real]
    assert [(f.filename, f.lineno, f.function) for f in shallow] == [(f.filename, f.lineno, f.function) for f in real]
    # utils.is_defined_in_class reads frames[2].code_context and .lineno; the first three carry them
    assert [f.code_context for f in shallow[:3]] == [f.code_context for f in real[:3]]
    assert all(f.code_context is None for f in shallow[3:])


def test_stack_restored_however_the_block_ends():
    real = inspect.stack
    with pytest.raises(ZeroDivisionError):
        with shallow_stacks():
            assert inspect.stack is shallow_stack
            1 / 0
    assert inspect.stack is real


# One PrimFunc, one IRModule class (TVM skips the methods' own parse through
# is_defined_in_class) and one PEP 563 annotation-only closure name (resolve_closure_vars
# finds `n` through the stack's frames): parsed under each stack, compared structurally.
_SCRIPT = textwrap.dedent('''
    from __future__ import annotations
    import tvm
    from tvm.script import ir as I, tirx as T

    def build():
        n = 16

        @T.prim_func(s_tir=True)
        def add_one(A: T.Buffer((n,), "float32"), B: T.Buffer((n,), "float32")):
            for i in range(n):
                with T.sblock("b"):
                    vi = T.axis.spatial(n, i)
                    B[vi] = A[vi] + T.float32(1)

        @I.ir_module
        class Mod:
            @T.prim_func(s_tir=True)
            def main(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
                for i in range(8):
                    with T.sblock("b"):
                        vi = T.axis.spatial(8, i)
                        B[vi] = A[vi] * T.float32(2)

        return add_one, Mod
''')


def test_tvmscript_parses_the_same_under_shallow_stacks(tmp_path, monkeypatch):
    import importlib.util

    import tvm

    path = tmp_path / "tvmscript_under_test.py"  # TVM's parser reads the source from a file
    path.write_text(_SCRIPT)
    spec = importlib.util.spec_from_file_location("tvmscript_under_test", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # TVM looks its source up by module
    spec.loader.exec_module(module)
    f_real, m_real = module.build()
    with shallow_stacks():
        f_shallow, m_shallow = module.build()
    assert isinstance(m_shallow, tvm.IRModule) and "main" in [g.name_hint for g in m_shallow.get_global_vars()]
    tvm.ir.assert_structural_equal(f_shallow, f_real)
    tvm.ir.assert_structural_equal(m_shallow, m_real)
    assert "T.Buffer((16,)" in f_shallow.script()  # the closure's n, found through the frames


@pytest.mark.slow
def test_tensor_intrinsics_register_without_inspect_stack():
    """In a fresh process (the import happens once per process): the whole of
    tvm.s_tir.tensor_intrin registers through the shallow stack, inspect.stack() itself is never
    called, and the intrinsics MetaSchedule's CPU rules use are there afterwards."""
    code = textwrap.dedent('''
        import inspect
        calls = []
        real = inspect.stack
        inspect.stack = lambda *a, **k: calls.append(1) or real(*a, **k)
        from blockforge.compile.schedule.intrinsics import import_tensor_intrinsics
        import_tensor_intrinsics()
        assert inspect.stack is not real  # restored to what it was: the counting wrapper
        from tvm.s_tir import TensorIntrin
        for name in ("dot_16x4_vnni", "dot_4x4_i8i8s32_sdot", "wmma_sync_16x16x16_f16f16f32"):
            TensorIntrin.get(name)
        print("real inspect.stack calls:", len(calls))
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "real inspect.stack calls: 0" in r.stdout, r.stdout
