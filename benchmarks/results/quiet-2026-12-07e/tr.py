import numpy as np, blockforge
blockforge.configure(redirect_native_output=False)
import tvm
from tvm import te, tirx, s_tir
from blockforge.compile.schedule.elementwise import CPUElementwise
from blockforge.targets import resolve
tgt = resolve("host").tvm_target()
C, H, W = 256, 64, 64
x = te.placeholder((1, C, H, W), "float32", name="x")
# the exporter's form: reshape (1, C, H/2, 2, W/2, 2)? keep it the plain (H*W, C) transpose through a reshape
y = te.compute((H * W, C), lambda i, c: x[0, c, i // W, i % W], name="T_transpose")
f = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
for tile in (True, False):
    with tgt:
        sch = CPUElementwise(tile_transposes=tile).apply(f, tgt, False)
    lib = tvm.compile(sch.mod, target=tgt)
    a = np.random.rand(1, C, H, W).astype("float32")
    ta, tb = tvm.runtime.tensor(a), tvm.runtime.tensor(np.zeros((H * W, C), "float32"))
    t = lib.jit().time_evaluator("main", tvm.cpu(), number=50, repeat=5)(ta, tb)
    assert np.array_equal(tb.numpy(), a[0].reshape(C, H * W).T)
    print("tile" if tile else "rows", f"{min(t.results)*1e3:.3f} ms", f"{C*H*W*8/min(t.results)/1e9:.1f} GB/s")
