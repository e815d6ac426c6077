"""`verify` reports relative error only where it means something: over elements where
rtol * |expected| >= atol. Near-zero expected values are judged by atol alone and do not
blow the relative column up; the err/allowed column is what decides pass or fail."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blockforge.graph.tolerance import Tolerance, compare

from conftest import run_cli_in_process

TOL = Tolerance(rtol=1e-4, atol=1e-5)  # float32 op row: relative error counts from |expected| >= 0.1


def test_near_zero_elements_do_not_set_the_relative_error():
    expected = np.array([1e-7, 1e-3, 0.05, 0.5, 2.0])
    err = np.array([5e-6, 1e-6, 1e-6, 1e-5, 2e-5])  # the first three: tiny against atol, huge against |e|
    c = compare("a vs b", "y", expected + err, expected, TOL)
    assert c.passed
    assert c.count == 5 and c.rel_count == 2  # 0.5 and 2.0
    assert c.max_rel == pytest.approx(2e-5)  # 1e-5 / 0.5, not 5e-6 / 1e-7 = 50
    assert c.max_abs == pytest.approx(2e-5)
    allowed = TOL.atol + TOL.rtol * np.abs(expected)
    assert c.tol_used == pytest.approx((err / allowed).max())
    assert c.tol_used < 1 and c.rel_floor == pytest.approx(0.1)


def test_all_near_zero_has_no_relative_error():
    expected = np.full((3, 4), 1e-6)
    c = compare("a vs b", "y", expected + 2e-6, expected, TOL)
    assert c.passed and c.max_rel is None and c.rel_count == 0 and c.count == 12


def test_failure_is_still_a_failure():
    """Leaving small values out of the relative column does not loosen the check."""
    expected = np.array([1e-6, 1.0])
    c = compare("a vs b", "y", expected + np.array([3e-5, 0.0]), expected, TOL)  # 3e-5 > atol on a near-zero
    assert not c.passed and c.tol_used > 1 and c.max_rel == 0.0
    c = compare("a vs b", "y", np.array([1e-6, 1.001]), expected, TOL)  # 1e-3 relative where rtol governs
    assert not c.passed and c.max_rel == pytest.approx(1e-3) and c.tol_used == pytest.approx(1e-3 / 1.1e-4)


def test_zero_atol_and_exact_zero():
    c = compare("a vs b", "y", np.zeros(4), np.zeros(4), Tolerance(rtol=1e-4, atol=0.0))
    assert c.passed and c.tol_used == 0.0 and c.max_rel is None  # 0 / 0 is no error, and no relative one


def test_verify_table_says_where_relative_error_counts(tmp_path):
    r = run_cli_in_process("export", "ffn", "--d-model", 64, "-o", tmp_path / "f.onnx", cwd=tmp_path)
    assert r.rc == 0, r.text
    r = run_cli_in_process("verify", tmp_path / "f.onnx", "--shape", "batch=1,seq=8", "--json", tmp_path / "rep.json",
                           cwd=tmp_path)
    assert r.rc == 0, r.text
    header = r.out.splitlines()[0]
    assert "max rel err (|expected| >= atol/rtol)" in header and "err/allowed" in header, r.out
    assert "relative error is left out" in r.out
    (c,) = json.loads((tmp_path / "rep.json").read_text())["comparisons"]
    assert c["count"] == 8 * 64 and 0 < c["rel_count"] <= c["count"]
    assert c["max_rel"] <= 2 * c["rtol"]  # where rtol governs, a pass keeps it within (atol + rtol|e|) / |e|
    row = next(ln for ln in r.out.splitlines() if ln.startswith("| ort vs oracle"))
    if c["rel_count"] < c["count"]:
        assert f"(n={c['rel_count']}/{c['count']})" in row, row
