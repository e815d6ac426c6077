"""`make check`'s source tree (tests/devtree.py) maps what the wheel maps."""

from __future__ import annotations

import subprocess
import sys

from devtree import REPO, build, setuptools_config


def test_every_wheel_package_is_in_the_dev_tree(tmp_path):
    dest = build(tmp_path / "dev-src")
    for pkg in setuptools_config()["packages"]:
        folder = dest.joinpath(*pkg.split("."))
        assert (folder / "__init__.py").is_file(), f"{pkg} missing from the dev tree"
    # Every module of core/ (the root package) is linked, not only the folders.
    assert {p.name for p in (REPO / "core").glob("*.py")} <= {p.name for p in (dest / "blockforge").iterdir()}
    assert build(tmp_path / "dev-src") == dest  # rebuilt in place


def test_dev_tree_is_imported_before_the_installed_copy(tmp_path):
    dest = build(tmp_path / "dev-src")
    code = "import blockforge.graph, blockforge.cli; print(blockforge.graph.__file__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(dest), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(dest / "blockforge" / "graph" / "__init__.py")
