"""Artifacts out and back: writing a compiled module with its manifest, checking manifests,
loading and running."""
