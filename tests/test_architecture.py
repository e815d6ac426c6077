"""The architecture holds: imports go one way between the stage folders, and importing
blockforge does nothing to the process."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# folder -> (package under blockforge, the packages it may import)
FOUNDATION = {"errors", "fsutil", "logs", "settings"}
LAYERS = {
    "graph": {"graph"},
    "targets": {"targets"},
    "compile": {"graph", "targets", "compile"},
    "tune": {"graph", "targets", "compile", "tune"},
    "bench": {"graph", "targets", "compile", "bench"},
    "deploy": {"graph", "targets", "compile", "deploy"},
}


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if mod == "blockforge":  # from blockforge import settings
                out += [(node.lineno, f"blockforge.{a.name}") for a in node.names]
    return [(ln, m) for ln, m in out if m == "blockforge" or m.startswith("blockforge.")]


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # `import blockforge` (the version): foundation
    return parts[1]


@pytest.mark.parametrize("folder", sorted(LAYERS) + ["core"])
def test_imports_go_one_way(folder):
    bad = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = path.relative_to(REPO / folder).with_suffix("")
        if folder == "core":
            if rel.parts[0] == "cli" or rel.name == "__main__":
                continue  # the CLI sits on top of everything
            package, allowed = "blockforge", set()
        else:
            package, allowed = f"blockforge.{folder}", LAYERS[folder]
        pkg = ".".join([package, *rel.parts[:-1]]) if rel.name != "__init__" else ".".join([package, *rel.parts[:-1]])
        for line, mod in _imports(path, pkg if rel.name == "__init__" else pkg):
            stage = _stage(mod)
            if stage is None or stage in FOUNDATION or stage in allowed or mod == "blockforge.settings":
                continue
            if folder == "core" and stage in FOUNDATION:
                continue
            bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    assert not bad, "imports against the layering (README, Architecture):\n" + "\n".join(bad)


def test_foundation_imports_no_stage():
    for name in FOUNDATION | {"__init__"}:
        for line, mod in _imports(REPO / "core" / f"{name}.py", "blockforge"):
            assert _stage(mod) in (None, *FOUNDATION), f"core/{name}.py:{line} imports {mod}"


def test_import_has_no_side_effects(tmp_path):
    code = """
import json, os, sys
before = dict(os.environ)
import blockforge, blockforge.graph, blockforge.targets, blockforge.compile, blockforge.tune
import blockforge.bench, blockforge.deploy, blockforge.cli
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({"changed": changed, "tvm": "tvm" in sys.modules}))
"""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["changed"] == [], f"importing blockforge changed the environment: {res['changed']}"
    assert list(tmp_path.iterdir()) == [], "importing blockforge wrote files"
    # TVM (1.5-3 s) loads when a verb needs it, never because a package was imported
    assert res["tvm"] is False, "importing the blockforge packages imported TVM"


def test_every_environment_variable_is_owned_by_settings():
    """BLOCKFORGE_* variables are read in one module (and documented in README)."""
    readme = (REPO / "README.md").read_text()
    from blockforge import settings

    # every module-level BLOCKFORGE_* name settings defines (a new one cannot be missed)
    names = [v for k, v in vars(settings).items() if k.isupper() and isinstance(v, str) and v.startswith("BLOCKFORGE_")]
    assert len(names) >= 8, names
    for name in names:
        assert f"`{name}`" in readme, f"{name} is not documented in README"
        assert f"`{name}`" in settings.__doc__, f"{name} is not in settings' own table"
    offenders = []
    for folder in (*LAYERS, "core"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "settings.py":
                continue
            text = path.read_text()
            if "os.environ" in text and "BLOCKFORGE_" in text:
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"read BLOCKFORGE_* outside settings.py: {offenders}"
