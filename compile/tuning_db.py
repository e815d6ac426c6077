"""Tuning databases per device (see the tuning issue); here: opening one for applying."""

from __future__ import annotations

from pathlib import Path

from blockforge.targets import ResolvedTarget


def default_db_dir(target: ResolvedTarget) -> Path:
    return Path("artifacts") / "tuning" / target.key()


def open_for_apply(target: ResolvedTarget, path: Path | None):
    """(database, info) for the build, or (None, None) when there are no records."""
    return None, None
