"""The source tree as an importable `blockforge`, for `make check` right after an edit.

The wheel maps top-level folders onto one namespace (pyproject.toml's package-dir: core/ ->
blockforge, graph/ -> blockforge.graph, ...), so the repository root cannot go on PYTHONPATH
as it is. This builds that layout out of symlinks under build/dev-src (the root package a real
folder holding links to core/'s entries, each stage folder one link), read from pyproject.toml
so it maps exactly what the wheel maps. PYTHONPATH=build/dev-src puts it before site-packages,
in pytest and in every child it starts (the CLI, isolation children, tuning workers): edits are
seen without reinstalling. CI still tests the installed wheel (`make test`, tests/test_wheel.py).

    python tests/devtree.py [DEST]     # prints DEST; rebuilt every call (milliseconds)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DEST = REPO / "build" / "dev-src"


def setuptools_config(pyproject: Path = REPO / "pyproject.toml") -> dict:
    """pyproject.toml's [tool.setuptools] table (package-dir, packages)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, vendored by setuptools
        from setuptools.extern import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(pyproject.read_text())["tool"]["setuptools"]


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    return dict(setuptools_config(pyproject)["package-dir"])


def build(dest: Path = DEFAULT_DEST, repo: Path = REPO) -> Path:
    mapping = package_dirs(repo / "pyproject.toml")
    if dest.is_symlink() or dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    # Shallow packages first: a package's folder must exist (as a real folder) before a
    # mapped sub-package can be linked inside it.
    for pkg in sorted(mapping, key=lambda p: p.count(".")):
        src = repo / mapping[pkg]
        target = dest.joinpath(*pkg.split("."))
        if target.parent.is_symlink() or not target.parent.is_dir():
            raise SystemExit(f"devtree: {pkg} maps inside a linked folder; map its parent as a real folder")
        children = {p.split(".")[-1] for p in mapping if p.rpartition(".")[0] == pkg}
        if children:  # a real folder: its own files linked, its mapped sub-packages added next
            target.mkdir()
            for entry in src.iterdir():
                if entry.name not in children and entry.name != "__pycache__":
                    os.symlink(entry, target / entry.name)
        else:
            os.symlink(src, target, target_is_directory=True)
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else DEFAULT_DEST))
