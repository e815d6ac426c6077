"""Convolution front ends: blockforge (conv-gemm, compile/conv) against ORT and OpenVINO f32.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/conv.py [--repeat 10] [--json out.json]

Cases (fp32, batch 1, random weights, the shapes of the real models):
  whisper_front   Whisper-base's conv front end: 80 mel x 3000 frames -> Conv k3 (512) + GELU
                  -> Conv k3 stride 2 (512) + GELU: (1, 512, 1500)
  wav2vec2_fe     Wav2Vec2-base's feature extractor on 16000 samples: Conv k10 s5 (512, no bias)
                  -> GroupNorm(512 groups; as InstanceNormalization) -> GELU, then Conv k3 s2 x4 and
                  k2 s2 x2 (512, no bias) each with GELU: (1, 512, 49)
  wav2vec2_pos    its positional conv: (1, 768, 49) -> Conv k128, pad 64, groups 16 (768) + GELU
  mobilevit_dw    MobileViT-small's depthwise pair: (1, 128, 128, 128) -> 3x3 s2 + SiLU -> 3x3 + SiLU
  segformer_dw    SegFormer-b0's Mix-FFN depthwise: (1, 128, 128, 128) -> 3x3 + GELU
  convnext_dw56   ConvNeXt-tiny's 7x7 depthwise at stage 1: (1, 96, 56, 56)
  convnext_dw14   and at stage 3: (1, 384, 14, 14)
  mobilevit_stem  MobileViT-small's stem: (1, 3, 256, 256) -> 3x3 s2 (16) + SiLU
  mobilevit_pw16  its pointwise expansions at 128 x 128: 16 -> 64 + SiLU
  mobilevit_pw32  and 32 -> 128 + SiLU
  resnet_s3       ResNet-50's stage-3 bottleneck at 14 x 14: 1x1 1024 -> 256, 3x3 256 -> 256, 1x1 256 -> 1024,
                  each + ReLU (L = 196 positions: 77% of four 64-wide column panels)
  resnet_s4       and stage 4's at 7 x 7: 1x1 2048 -> 512, 3x3 512 -> 512, 1x1 512 -> 2048 (L = 49)
Each case is one `blockforge bench` run: the contenders interleaved in this process, outputs
checked against ORT before timing. The table gives median ms, GFLOP/s (the convs' 2 x MACs)
and the ratio to OpenVINO from the same samples, with the 1-minute load average: on a shared
machine only those ratios mean anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as oh
from onnx import numpy_helper as nh

import blockforge
from blockforge.bench import BenchOptions, bench
from blockforge.fsutil import atomic_write_json


class _Graph:
    """A chain of Conv (+ norm) + Gelu nodes on one input, random weights (seeded)."""

    def __init__(self, name: str, shape: tuple[int, ...]):
        self.name, self.shape = name, shape
        self.nodes, self.inits, self.cur, self.rng = [], [], "x", np.random.default_rng(0)

    def _const(self, stem: str, a: np.ndarray) -> str:
        n = f"{stem}{len(self.inits)}"
        self.inits.append(nh.from_array(a.astype(np.float32), n))
        return n

    def _then(self, op: str, inputs: list[str], **attrs) -> None:
        out = f"t{len(self.nodes)}"
        self.nodes.append(oh.make_node(op, [self.cur, *inputs], [out], **attrs))
        self.cur = out

    def conv(self, cin: int, cout: int, k: int, *, stride=1, pad=0, groups=1, bias=True) -> "_Graph":
        w = self.rng.standard_normal((cout, cin // groups, k)) / np.sqrt(cin // groups * k)
        ins = [self._const("w", w)] + ([self._const("b", self.rng.standard_normal(cout) * 0.1)] if bias else [])
        self._then("Conv", ins, strides=[stride], pads=[pad, pad], group=groups)
        return self

    def conv2d(self, cin: int, cout: int, k: int, *, stride=1, pad=0, groups=1) -> "_Graph":
        w = self.rng.standard_normal((cout, cin // groups, k, k)) / np.sqrt(cin // groups * k * k)
        b = self.rng.standard_normal(cout) * 0.1
        self._then("Conv", [self._const("w", w), self._const("b", b)], strides=[stride, stride], pads=[pad] * 4,
                   group=groups)
        return self

    def silu(self) -> "_Graph":
        x = self.cur
        self._then("Sigmoid", [])
        out = f"t{len(self.nodes)}"
        self.nodes.append(oh.make_node("Mul", [x, self.cur], [out]))
        self.cur = out
        return self

    def instance_norm(self, c: int) -> "_Graph":
        self._then("InstanceNormalization", [self._const("g", np.ones(c)), self._const("beta", np.zeros(c))],
                   epsilon=1e-5)
        return self

    def relu(self) -> "_Graph":
        self._then("Relu", [])
        return self

    def gelu(self) -> "_Graph":
        self._then("Gelu", [])
        return self

    def save(self, d: Path) -> Path:
        g = oh.make_graph(self.nodes, self.name, [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, self.shape)],
                          [oh.make_tensor_value_info(self.cur, onnx.TensorProto.FLOAT, None)], self.inits)
        m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
        out = onnx.shape_inference.infer_shapes(m).graph.output[0]  # the checker wants its shape
        m.graph.output[0].CopyFrom(out)
        path = d / f"{self.name}.onnx"
        onnx.save(m, path)
        return path


def cases(smoke: bool) -> list[_Graph]:
    mel, frames, c, samples, hid, k_pos = (80, 3000, 512, 16000, 768, 128) if not smoke else (8, 64, 16, 800, 32, 8)
    whisper = _Graph("whisper_front", (1, mel, frames)).conv(mel, c, 3, pad=1).gelu().conv(c, c, 3, stride=2, pad=1).gelu()
    w2v = _Graph("wav2vec2_fe", (1, 1, samples)).conv(1, c, 10, stride=5, bias=False).instance_norm(c).gelu()
    for k in (3, 3, 3, 3, 2, 2):
        w2v.conv(c, c, k, stride=2, bias=False).gelu()
    pos = _Graph("wav2vec2_pos", (1, hid, 49 if not smoke else 12)).conv(hid, hid, k_pos, pad=k_pos // 2, groups=16).gelu()
    # Depthwise 2-D convs (compile/conv/depthwise.py) as the vision families have them:
    # MobileViT-small's MobileNetV2 blocks (3x3, stride 2 then 1, SiLU), SegFormer-b0's Mix-FFN
    # (3x3 on its hidden 4C, GELU), ConvNeXt-tiny's 7x7 at its first and third stage.
    s = 1 if not smoke else 4
    mvit = _Graph("mobilevit_dw", (1, 128 // s, 128 // s, 128 // s)).conv2d(128 // s, 128 // s, 3, stride=2, pad=1,
                                                                      groups=128 // s).silu()
    mvit.conv2d(128 // s, 128 // s, 3, pad=1, groups=128 // s).silu()
    seg = _Graph("segformer_dw", (1, 128 // s, 128 // s, 128 // s)).conv2d(128 // s, 128 // s, 3, pad=1,
                                                                     groups=128 // s).gelu()
    cnx56 = _Graph("convnext_dw56", (1, 96 // s, 56, 56)).conv2d(96 // s, 96 // s, 7, pad=3, groups=96 // s)
    cnx14 = _Graph("convnext_dw14", (1, 384 // s, 14, 14)).conv2d(384 // s, 384 // s, 7, pad=3, groups=384 // s)
    # MobileViT-small's convs at 128 x 128 with few input channels: its stem (3x3 stride 2 on the
    # 256 x 256 image) and the two pointwise expansions (K = 16 and 32 rows of the GEMM) + SiLU.
    stem = _Graph("mobilevit_stem", (1, 3, 256 // s, 256 // s)).conv2d(3, 16, 3, stride=2, pad=1).silu()
    pw16 = _Graph("mobilevit_pw16", (1, 16, 128 // s, 128 // s)).conv2d(16, 64, 1).silu()
    pw32 = _Graph("mobilevit_pw32", (1, 32, 128 // s, 128 // s)).conv2d(32, 128, 1).silu()
    r3 = _Graph("resnet_s3", (1, 1024 // s, 14, 14))
    r4 = _Graph("resnet_s4", (1, 2048 // s, 7, 7))
    for g, c in ((r3, 256 // s), (r4, 512 // s)):
        g.conv2d(4 * c, c, 1).relu().conv2d(c, c, 3, pad=1).relu().conv2d(c, 4 * c, 1).relu()
    return [whisper, w2v, pos, mvit, seg, cnx56, cnx14, stem, pw16, pw32, r3, r4]


def ablation_ab(g: _Graph, d: Path, ablation: str, repeat: int) -> tuple[str, dict[str, float]]:
    """blockforge built with and without `ablation` (pipeline.ABLATIONS, comma list), interleaved in one
    process with ORT and OpenVINO f32 (outputs checked against ORT first): median ms each."""
    import tvm
    from tvm import relax

    from blockforge.bench.contenders import OpenVino, Ort
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.frontend.importer import import_onnx
    from blockforge.compile.pipeline import build
    from blockforge.targets import resolve

    model = onnx.load(g.save(d))
    x = np.random.default_rng(1).standard_normal(g.shape).astype(np.float32)
    target = resolve("host")
    threads = int(target.target_json.get("num-cores", 1))
    bm = type("M", (), {"onnx": model})()
    runners = {"ort": Ort().make_runner(bm, {"x": x}, threads)}
    want = runners["ort"].outputs()[0]
    if OpenVino().available():
        runners["openvino"] = OpenVino().make_runner(bm, {"x": x}, threads, precision="f32")
    for label, without in (("new", set()), (f"without {ablation}", set(ablation.split(",")))):
        vm = relax.VirtualMachine(build(import_onnx(model), target, without=without).executable, tvm.cpu())
        a = tvm.runtime.tensor(x)
        np.testing.assert_allclose(vm["main"](a).numpy(), want, rtol=2e-3, atol=2e-3)
        runners[label] = (lambda f=vm["main"], a=a: f(a))
    samples = measure_interleaved(runners, repeat, warmup=1)
    return g.name, {k: float(np.median(v)) for k, v in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--against", default="ort,openvino,untuned")
    ap.add_argument("--json", type=Path, default=None, help="also write the reports here")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, 3 samples: proves the script runs (tests/test_benchmarks.py)")
    ap.add_argument("--ab", default=None, metavar="ABLATION",
                    help="instead: blockforge with and without these pipeline ablations (comma list), interleaved with the peers")
    ap.add_argument("--case", action="append", default=None, help="only these cases (repeatable)")
    a = ap.parse_args()
    blockforge.configure()  # TVM's pool = physical cores, as the CLI sets it
    repeat = 3 if a.smoke else a.repeat
    if a.ab:
        with tempfile.TemporaryDirectory() as tmp:
            for g in [g for g in cases(a.smoke) if not a.case or g.name in a.case]:
                name, ms = ablation_ab(g, Path(tmp), a.ab, repeat)
                best = min(v for k, v in ms.items() if k in ("ort", "openvino"))
                print(f"{name}: " + ", ".join(f"{k} {v / best:.2f}x" for k, v in ms.items())
                      + f" of the best peer ({best:.3f} ms); new / without {ms['new'] / ms[f'without {a.ab}']:.2f};"
                      f" load {os.getloadavg()[0]:.2f}", flush=True)
        return 0
    rows, reports = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for g in cases(a.smoke):
            r = bench(BenchOptions(model=g.save(Path(tmp)), against=tuple(a.against.split(",")), repeat=repeat,
                                   warmup=1, gemm_n=256 if a.smoke else 2048))
            reports[g.name] = r.to_dict()
            by = {x.name: x for x in r.results}
            ov = by.get("openvino")
            for x in r.results:
                gf = r.flops / (x.median_ms * 1e6) if x.median_ms else 0.0
                vs = f"{x.median_ms / ov.median_ms:.2f}x" if ov else "-"
                rows.append(f"| {g.name} | {x.name} | {x.median_ms:.2f} | {gf:.1f} | {vs} |")
            for note in r.notes:
                print(f"note ({g.name}): {note}", file=sys.stderr)
    load = os.getloadavg()[0]
    print(f"load average (1 min) {load:.2f}; {r.threads} threads")
    print("| case | contender | ms | GFLOP/s | vs openvino |\n|---|---|---|---|---|")
    print("\n".join(rows))
    if a.json:
        atomic_write_json(a.json, {"load_avg_1m": load, "rows": rows, "reports": reports})
    return 0


if __name__ == "__main__":
    sys.exit(main())
