"""Targets as data: presets resolve in one place; bad targets are one clear error."""

import json

import pytest

from blockforge.errors import BlockforgeError
from blockforge.targets import PRESETS, list_targets, resolve
from blockforge.targets.toolchain import nvcc

from conftest import assert_user_error, run_cli


def test_every_preset_resolves_to_a_tvm_target():
    for name in PRESETS:
        r = resolve(name)
        t = r.tvm_target()
        assert str(t.kind.name) == r.kind
        assert "<" not in json.dumps(r.target_json), "unfilled placeholder"


def test_host_is_native():
    import tvm

    r = resolve("host")
    assert r.target_json["mcpu"] == str(tvm.target.codegen.llvm_get_system_cpu())
    assert r.target_json["num-cores"] >= 1 and r.run_problem() is None


def test_custom_json_and_keys():
    r = resolve('{"kind": "llvm", "mcpu": "haswell", "num-cores": 4}')
    assert r.name == "custom" and r.device == "cpu" and r.key() == "llvm-haswell-4c"
    assert resolve("cuda-sm90").key() != resolve("cuda-sm80").key()
    assert resolve("aarch64-linux").arch == "aarch64"


@pytest.mark.parametrize("value, fragment", [
    ("tpu-v9", "unknown target"),
    ("{not json", "malformed target JSON"),
    ('{"mcpu": "x"}', "kind"),
    ('{"kind": "warp-drive"}', "TVM rejects target"),
])
def test_bad_targets(value, fragment):
    with pytest.raises(BlockforgeError, match=fragment):
        resolve(value)


def test_capabilities_listed(tmp_path):
    rows = {r["name"]: r for r in list_targets()}
    assert rows["host"]["can_build"] and rows["host"]["can_run"]
    nvcc_here = nvcc() is not None
    assert rows["cuda-sm90"]["can_build"] == nvcc_here  # nvcc is enough to build, no GPU needed
    if not nvcc_here:
        assert "nvcc" in rows["cuda-sm90"]["build_problem"]
    for build_only in ("opencl", "metal", "webgpu"):
        assert not rows[build_only]["can_run"] and "build-only" in rows[build_only]["run_problem"]
    r = run_cli("targets", cwd=tmp_path)
    assert r.rc == 0 and "cuda-sm90" in r.out and "aarch64-linux" in r.out


def test_missing_cross_compiler_names_package(tmp_path, monkeypatch):
    model = tmp_path / "f.onnx"
    assert run_cli("export", "ffn", "--d-model", 16, "-o", model, cwd=tmp_path).rc == 0
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    # With the cross compiler hidden from PATH the error names the Debian package.
    r = run_cli("compile", model, "--target", "aarch64-linux", cwd=tmp_path, env={"PATH": str(empty)})
    assert_user_error(r, "aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
