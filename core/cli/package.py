"""`blockforge package`: what an edge device needs (module, manifest, runtime, app)."""

from __future__ import annotations

from .common import add_force


def add(sub) -> None:
    p = sub.add_parser("package", help="gather what an edge device needs: module, manifest, runtime, app")
    p.add_argument("artifact")
    p.add_argument("-o", "--output", default=None, help="package dir (default <artifact>.pkg)")
    p.add_argument("--app", action="store_true", help="also build and include the C++ edge app and run.sh")
    add_force(p, "an existing output that is not a blockforge package, or ")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.deploy import PackageOptions, package_artifact

    res = package_artifact(PackageOptions(artifact=a.artifact, output=a.output, app=a.app, force=a.force))
    total = sum(res.files.values())
    print(f"packaged {a.artifact} for {res.arch} -> {res.path}/ ({total / 2**20:.1f} MiB)")
    for name, size in sorted(res.files.items()):
        print(f"  {name:28} {size / 2**10:10.1f} KiB")
    return 0
