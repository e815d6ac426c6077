"""Deployment: packaging an artifact with the TVM runtime and the C++ edge app (whose
sources ship inside this package, in edge_app/)."""

from .package import PackageOptions, PackageResult, build_app, package_artifact, runtime_libs

__all__ = ["PackageOptions", "PackageResult", "build_app", "package_artifact", "runtime_libs"]
