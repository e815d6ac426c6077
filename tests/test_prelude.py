"""The prelude (compile/session.py open_model) loads, checks, binds and prepares a model once:
the isolation child does it and hands back what it made; the parent does not redo it (issue
#18: one compile loaded twice, bound three times, ran the checker three times and prepare twice).
The shape as a type: ShapeRequest (parsed by argparse) and Binding (signatures without
copying the model)."""

from __future__ import annotations

import collections
import json

import onnx
import onnxslim
import pytest

from blockforge.errors import BlockforgeError
from blockforge.graph import FFNSpec, export
from blockforge.graph.model_io import TensorSig, bind_dims, signature

# The isolation child is under test here (tests/conftest.py turns it off elsewhere).
pytestmark = pytest.mark.isolation


@pytest.fixture
def counted(monkeypatch):
    """Calls of the third-party functions each step ends in: the file's parse (load), the
    ONNX checker, shape inference (bind/prepare) and onnxslim (prepare)."""
    calls = collections.Counter()

    def count(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, wrapper)

    count(onnx, "load_model", "load")
    count(onnx.checker, "check_model", "checker")
    count(onnx.shape_inference, "infer_shapes", "infer_shapes")
    count(onnxslim, "slim", "prepare")
    return calls


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    return export(FFNSpec(d_model=32, d_ff=64), tmp_path_factory.mktemp("prelude") / "ffn.onnx").model_path


def test_one_compile_does_the_prelude_once_in_the_child(ffn, tmp_path, counted, monkeypatch):
    """With isolation on, the parent reads the child's prepared model back: it parses one
    file (the prepared model, not the original) and runs neither the checker, nor shape
    inference, nor prepare."""
    from blockforge.compile import CompileOptions, compile_model

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "1")
    res = compile_model(CompileOptions(model=ffn, target="host", shape={"batch": 1, "seq": 8},
                                       output=tmp_path / "art", use_tuning=False))
    assert dict(counted) == {"load": 1}, dict(counted)
    assert res.manifest["dims"] == {"batch": 1, "seq": 8} and res.manifest["phases"][0] == "prepare"
    assert res.manifest["inputs"][0]["shape"] == [1, 8, 32]


@pytest.fixture
def started(monkeypatch):
    """The isolation children Popen started, as Popen objects. Recorded rather than looked
    up in /proc: a child that had already exited (the missing model's fails fast) or a
    listing read at the wrong moment made the lookup flaky (1 CI run in ~20)."""
    import subprocess

    from blockforge.compile import isolate

    children = []

    class Recording(subprocess.Popen):
        def __init__(self, cmd, *a, **kw):
            super().__init__(cmd, *a, **kw)
            if "blockforge.compile.isolate" in cmd:
                children.append(self)

    monkeypatch.setattr(isolate.subprocess, "Popen", Recording)
    return children


def test_the_target_is_resolved_while_the_child_reads_the_model(ffn, tmp_path, monkeypatch, started):
    """The parent's own work (resolving the target imports TVM: 3-4 s) runs while the
    isolation child works, not after it; a refused target still comes first, whatever the
    model, and its child is ended (killed and reaped: its returncode is set)."""
    from blockforge.compile import session

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "1")
    seen, real = [], session.resolve

    def resolve(name):
        # Started and not yet reaped: the parent reaps it (os.wait4) only after resolve.
        seen.append([p.returncode for p in started])
        return real(name)

    monkeypatch.setattr(session, "resolve", resolve)
    s = session.open_model(ffn, "host", {"batch": 1, "seq": 8})
    assert seen == [[None]] and s.target.name == "host" and s.prepared is not None, seen

    def refuse(name):
        assert started and started[-1].returncode is None, "the child had not been started"
        raise BlockforgeError(f"no target {name} here")

    monkeypatch.setattr(session, "resolve", refuse)
    for model in (ffn, tmp_path / "missing.onnx"):
        before = len(started)
        with pytest.raises(BlockforgeError, match="no target host here"):
            session.open_model(model, "host", {"batch": 1, "seq": 8})
        assert len(started) == before + 1
        child = started[-1]
        assert child.returncode is not None, "the child was left running"
        assert child.returncode < 0 or model.name == "missing.onnx", child.returncode  # killed, unless done first


def test_in_process_prelude_checks_each_model_once(ffn, counted, monkeypatch):
    """Isolation off, the same work runs here: one load, one checker run per model (the
    original, the prepared), one prepare, and the import does not check again."""
    from blockforge.compile.session import open_model

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    s = open_model(ffn, "host", {"batch": 1, "seq": 8})
    s.relax()
    assert counted["load"] == 1 and counted["checker"] == 2 and counted["prepare"] == 1, dict(counted)
    assert [x.dims for x in s.inputs] == [(1, 8, 32)]


def test_verify_reuses_an_opened_session(ffn, counted, monkeypatch):
    """verify(opts, session): the caller's open_model is the only prelude (one prepare; the
    two loads are the prelude's and the model as written that ORT runs, as in a verify on its
    own); a session of another model or precision, or one not opened for a build, is refused
    before anything runs."""
    from blockforge.compile import VerifyOptions, verify
    from blockforge.compile.session import open_model
    from blockforge.errors import ArgumentError

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "0")
    opts = VerifyOptions(model=ffn, target="host", shape={"batch": 1, "seq": 8}, use_tuning=False)
    s = open_model(ffn, "host", {"batch": 1, "seq": 8})
    assert verify(opts, s).passed
    reused = dict(counted)
    assert reused["prepare"] == 1 and reused["load"] == 2, reused
    counted.clear()
    assert verify(opts).passed  # on its own: its own prelude, the same work
    assert dict(counted) == reused, (dict(counted), reused)
    other = export(FFNSpec(d_model=16, d_ff=32), ffn.parent / "other.onnx").model_path
    for bad in (VerifyOptions(model=other, target="host", shape={"batch": 1, "seq": 8}),
                VerifyOptions(model=ffn, target="host", shape={"batch": 1, "seq": 8}, precision="bf16")):
        with pytest.raises(ArgumentError, match="is not .* opened for a build") as info:
            verify(bad, s)
        assert info.value.argument == "session"
    with pytest.raises(ArgumentError, match="opened for a build"):
        verify(opts, open_model(ffn, None, {"batch": 1, "seq": 8}, prepare=False))
    with pytest.raises(ArgumentError, match="opened for a build"):  # no target: nothing would use it
        verify(VerifyOptions(model=ffn, shape={"batch": 1, "seq": 8}), s)


def test_child_hands_back_weights_on_disk(ffn, monkeypatch):
    """The child's prepared model keeps its weights as external data in its folder; the
    importer reads them from there, and the folder lives as long as the session."""
    from blockforge.compile.session import open_model

    monkeypatch.setenv("BLOCKFORGE_ISOLATE", "1")
    s = open_model(ffn, "host", {"batch": 1, "seq": 8})
    external = [t for t in s.prepared.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and s.weights_dir.is_dir(), "weights are not left on disk"
    assert not any(t.HasField("raw_data") for t in external)
    s.relax()
    whole = s.prepared_with_weights()
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in whole.graph.initializer)


def test_read_external_stays_in_its_folder(tmp_path):
    """A child's result is read under the folder policy: a location outside the folder, or
    a length the dims do not need, is one error (the child worked on an untrusted model)."""
    from blockforge.graph.model_io import read_external

    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    t = onnx.helper.make_tensor("w", onnx.TensorProto.FLOAT, [2, 2], [0.0] * 4)
    t.ClearField("float_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    for entries, frag in (({"location": "../w.bin"}, "not a file"), ({"location": "/etc/passwd"}, "not a file"),
                          ({"location": "w.bin", "length": "8"}, "need 16"),
                          ({"location": "w.bin", "offset": "8"}, "need 16")):
        del t.external_data[:]
        for k, v in entries.items():
            t.external_data.add(key=k, value=v)
        with pytest.raises(BlockforgeError, match=frag):
            read_external(t, tmp_path)
    del t.external_data[:]
    t.external_data.add(key="location", value="w.bin")
    assert read_external(t, tmp_path).shape == (2, 2)


def test_binding_signature_matches_bind_dims_without_copying(ffn):
    from blockforge.graph.shape import Binding, ShapeRequest

    model = onnx.load(str(ffn))
    ins, outs = signature(model)
    b = Binding.resolve(ins, outs, ShapeRequest.parse("batch=2,seq=5"))
    assert b.signature() == signature(bind_dims(model, {"batch": 2, "seq": 5}))
    assert b.unbound() == [] and Binding.from_dict(json.loads(json.dumps(b.to_dict()))) == b
    partial = Binding.resolve(ins, outs, ShapeRequest.parse("batch=2"))
    assert partial.unbound() == ["seq"] and partial.signature()[0][0].dims == (2, "seq", 32)
    assert TensorSig("x", ("a", 3), "float32").at({"a": 4}).dims == (4, 3)


def test_shape_request_parsed_by_argparse():
    """--shape is parsed once, by argparse (`type=`), into the request the library takes."""
    from blockforge.cli import build_parser
    from blockforge.graph.shape import ShapeRequest

    a = build_parser().parse_args(["compile", "m.onnx", "--target", "host", "--shape", "batch=1,input_ids=1x8"])
    assert a.shape == ShapeRequest((("batch", 1), ("input_ids", (1, 8))))
    assert ShapeRequest.of({"input_ids": [1, 8]}) == ShapeRequest((("input_ids", (1, 8)),))
    assert ShapeRequest.of(a.shape) is a.shape and not ShapeRequest.parse(None)
