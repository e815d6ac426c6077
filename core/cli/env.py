"""`blockforge env`: where things are (cache, log, tuning databases) and what runs here."""

from __future__ import annotations

import json
from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser("env", help="where blockforge keeps its state, and the versions and CPU here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def collect() -> dict:
    import platform

    import blockforge
    from blockforge import settings
    from blockforge.compile.records.reader import read_contents
    from blockforge.errors import BlockforgeError
    from blockforge.targets.toolchain import cpu_model, package_version

    dbs = []
    edge = settings.edge_build_root()
    root = settings.tuning_root()
    if root.is_dir():
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            try:
                c = read_contents(d, tolerate_torn_tail=True)
                dbs.append({"device": d.name, "path": str(d), "workloads": len(c.workloads), "records": len(c.records)})
            except BlockforgeError as e:
                dbs.append({"device": d.name, "path": str(d), "error": str(e)})
    return {
        "blockforge": blockforge.__version__,
        "cache_dir": str(settings.cache_dir()),
        "log_file": str(settings.log_file()),
        "tuning_root": str(root),
        "tuning_databases": dbs,
        "edge_builds": str(edge),
        "edge_built": sorted(p.parent.parent.name for p in edge.glob("*/bin/edge_app")),  # arches
        "package": str(Path(blockforge.__file__).parent),
        "settings": settings.documented(),
        "settings_source": {k: settings.source(k) for k in settings.documented()},
        "versions": {k: package_version(k) for k in ("apache-tvm", "apache-tvm-ffi", "onnx", "onnxruntime-gpu",
                                              "onnxruntime", "numpy", "openvino")},
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "physical_cores": settings.physical_cores(),
    }


def run(a) -> int:
    info = collect()
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"blockforge {info['blockforge']} (python {info['python']}) on {info['cpu']} "
          f"({info['machine']}, {info['physical_cores']} physical cores)")
    print(f"package     {info['package']}")
    print(f"cache       {info['cache_dir']}")
    print(f"log         {info['log_file']}")
    built = ", ".join(info["edge_built"]) or "none yet: `blockforge package --app` builds one per arch"
    print(f"edge builds {info['edge_builds']} ({built})")
    print(f"tuning      {info['tuning_root']}")
    for d in info["tuning_databases"]:
        print(f"  {d['device']:40} " + (d["error"] if "error" in d else f"{d['records']} records, {d['workloads']} workloads"))
    if not info["tuning_databases"]:
        print("  (no databases yet: `blockforge tune` creates one per device)")
    print("versions    " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v))
    print("settings")
    for k, v in info["settings"].items():
        print(f"  {k:27} {v}  ({info['settings_source'][k]})")
    return 0
