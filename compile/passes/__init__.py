"""Relax/TIR rewrites of blockforge's own, each a pipeline phase or part of one."""
