"""Where it runs: the preset table and its resolution to TVM targets."""

from .presets import PRESETS
from .resolve import ResolvedTarget, list_targets, resolve

__all__ = ["PRESETS", "ResolvedTarget", "list_targets", "resolve"]
