"""The whole-model peer table in one command (issue #20): full-size Hugging Face models against
ONNX Runtime, ORT's transformer optimizer (ort-fused) and OpenVINO f32, on a quiet machine.

    .venv/bin/python benchmarks/whole_models.py --export-python /work/export-venv/bin/python
        [--only bert_base,t5_base_encoder] [--repeat 20] [--quiet-ceiling GFLOPS] [--cache-dir DIR]
    .venv/bin/python benchmarks/whole_models.py --smoke      # the committed tiny exports, 3 samples

Models (benchmarks/export_models.py `WHOLE`: random weights from configs, transformers'
default attention, torch's dynamo exporter at opset 18): BERT-base seq 128, GPT-2 small seq
128, a Llama-style decoder (12 layers, 768 wide, GQA 12/4) seq 128, ViT-B/16 224x224, the
Whisper-base encoder on 30 s of audio, Wav2Vec2-base on 1 s of 16 kHz audio, CLIP ViT-B/32's
vision tower 224x224 and T5-base's encoder seq 128; batch 1, fp32.

Each model is exported once by --export-python (an interpreter with torch and transformers)
into --cache-dir, keyed by the content hash of export_models.py and the model's name, and
reused while the file's sha256 matches its entry. Each is one `bench` run (bench/harness.py):
blockforge compiled once, untuned, against ort, ort-fused and openvino, every output checked
against ONNX Runtime before timing, interleaved samples, the SGEMM ceiling measured after the
samples, a per-kernel profile. Load average before and after each model; SGEMM ceiling before,
after each model and at the end.

A run is quotable only when every SGEMM ceiling it measured is at least 90% of the quiet
value (--quiet-ceiling, default: the last quiet value under --out, from a quotable run of
this script or a quiet-YYYY-MM-DD/ pass). Writes <out>/whole-models-<host>.{json,md,png};
a run that is not quotable goes to whole-models-<host>-not-quotable.* (never over a quotable
table), --smoke to whole-models-smoke.*. A model that cannot run is a "failed" row (exit 1).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import blockforge
from blockforge.bench import BenchOptions, bench, plot
from blockforge.bench.harness import host_facts, sgemm_ceiling
from blockforge.bench.report import KERNEL_CLASSES, QUOTABLE_FRACTION, class_shares
from blockforge.errors import BlockforgeError
from blockforge.fsutil import atomic_write_json, atomic_write_text, sha256_file
from blockforge.settings import cache_dir

HERE = Path(__file__).resolve().parent
EXPORTER = HERE / "export_models.py"
SMOKE_MODELS = HERE.parent / "tests" / "fixtures" / "whole_models"  # export_models.py whole --tiny
SCHEMA = "blockforge.whole_models/1"
AGAINST = ("ort", "ort-fused", "openvino", "untuned")
TOP_KERNELS = 5


class UserError(Exception):
    """One line on stderr, exit 2."""


def load_exporter():
    """benchmarks/export_models.py as a module, without torch (it imports torch only inside
    functions): its WHOLE table and the source of the functions that export it."""
    spec = importlib.util.spec_from_file_location("export_models", EXPORTER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# What an export of a WHOLE entry depends on: its entry and these functions (not the rest of
# export_models.py, so an edit of the test corpus there does not re-export 3.5 GB of models).
RECIPE = ("make_whole", "export_whole", "_dynamo_export", "_finish_export", "_Wrapped")


def recipe_key(mod, name: str) -> str:
    parts = [json.dumps(mod.WHOLE[name], sort_keys=True), str(mod.WHOLE_OPSET)]
    source = EXPORTER.read_text()
    defs = {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    parts += [defs[f] for f in RECIPE]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def verified_entry(onnx_path: Path) -> dict | None:
    """The export's entry when the file beside it is the one the entry describes (the cache is
    a user's directory: a truncated or replaced file is exported again, never benchmarked)."""
    meta = onnx_path.with_suffix(".json")
    try:
        entry = json.loads(meta.read_text())
        ok = isinstance(entry, dict) and entry.get("sha256") == sha256_file(onnx_path)
    except (OSError, ValueError):
        return None
    return entry if ok else None


def cached_export(mod, name: str, cache: Path, export_python: str | None) -> tuple[Path, dict, bool]:
    """(model path, its entry, reused?): exported once per content of its recipe."""
    final = cache / f"{name}-{recipe_key(mod, name)}"
    path = final / f"{name}.onnx"
    if path.is_file() and (entry := verified_entry(path)) is not None:
        return path, entry, True
    if not export_python:
        raise UserError(f"{name} is not in the cache ({final}): give --export-python (an interpreter with "
                        "torch and transformers: pip install 'blockforge[export]') to export it")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        try:
            p = subprocess.run([export_python, str(EXPORTER), "whole", "--models", name, "--out", str(tmp)],
                               capture_output=True, text=True)
        except OSError as e:
            raise UserError(f"--export-python {export_python}: cannot run it ({e.strerror or e})") from None
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise UserError(f"exporting {name} with {export_python} failed (rc {p.returncode}): {tail}")
        if verified_entry(tmp / f"{name}.onnx") is None:
            raise UserError(f"exporting {name} wrote no model with a matching entry in {tmp}")
        if final.exists():
            shutil.rmtree(final)  # a stale copy whose file no longer matched its entry
        os.replace(tmp, final)  # whole directory at once: a killed export leaves only a .tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, verified_entry(path), False


def smoke_model(name: str) -> tuple[Path, dict, bool]:
    path = SMOKE_MODELS / f"{name}.onnx"
    entry = verified_entry(path) if path.is_file() else None
    if entry is None:
        raise UserError(f"no tiny export of {name} in {SMOKE_MODELS} (run export_models.py whole --tiny --out there)")
    return path, entry, True


def last_quiet_ceiling(results: Path) -> tuple[float, str] | None:
    """(GFLOP/s, where it came from) of the newest quiet measurement under `results`: a quotable
    run of this script (its median ceiling), or a quiet-YYYY-MM-DD/ pass (the median of every
    sgemm_gflops its JSON files hold)."""
    found = []  # (date, value, source)
    for f in results.glob("whole-models-*.json"):
        try:
            d = json.loads(f.read_text())
            if d.get("schema") == SCHEMA and d.get("quotable") is True:
                found.append((d["date"], float(d["sgemm"]["median"]), str(f)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for folder in results.glob("quiet-*"):
        m = re.fullmatch(r"quiet-(\d{4}-\d{2}-\d{2})", folder.name)
        if not m or not folder.is_dir():
            continue
        values = []
        for f in folder.rglob("*.json"):
            try:
                values += list(_sgemm_values(json.loads(f.read_text())))
            except (OSError, ValueError):
                continue
        if values:
            found.append((m.group(1), statistics.median(values), f"{folder} (median of {len(values)} ceilings)"))
    if not found:
        return None
    date, value, source = max(found)
    return value, source


def _sgemm_values(d):
    if isinstance(d, dict):
        for k, v in d.items():
            if k == "sgemm_gflops" and isinstance(v, (int, float)) and v > 0:
                yield float(v)
            else:
                yield from _sgemm_values(v)
    elif isinstance(d, list):
        for v in d:
            yield from _sgemm_values(v)


def spread(samples: list[float]) -> dict:
    q = np.percentile(samples, [0, 10, 25, 50, 75, 90, 100])
    return dict(zip(("min", "p10", "p25", "median", "p75", "p90", "max"), (round(float(x), 4) for x in q)))


def model_row(name: str, entry: dict, rep, load: tuple, wall_s: float, reused: bool) -> dict:
    kernels = rep.profile.get("untuned", [])
    return {
        "model": name, "family": entry.get("family"), "file_sha256": entry.get("sha256"),
        "export": {k: entry.get(k) for k in ("exporter", "opset", "config", "versions", "bytes")}, "reused_export": reused,
        "inputs": entry.get("run_inputs"), "dims": rep.dims, "gflop": rep.flops / 1e9, "threads": rep.threads,
        "sgemm_gflops": rep.sgemm_gflops, "load_avg_1m": {"before": load[0], "after": load[1]}, "wall_s": round(wall_s, 1),
        "best_peer": rep.best_peer, "headline": rep.headline,
        "contenders": {r.name: {"peer": r.peer, "ms": spread(r.samples_ms), "gflops": r.gflops,
                                "pct_of_sgemm": r.pct_of_sgemm, "ratio_to_best_peer": r.ratio_to_best_peer}
                       for r in rep.results},
        "profile": {"classes_pct": class_shares(kernels) if kernels else None,
                    "top_kernels": [{"name": k.name, "calls": k.calls, "ms": k.total_ms, "pct": k.pct}
                                    for k in kernels[:TOP_KERNELS]]},
        "notes": rep.notes,
    }


def markdown(doc: dict) -> str:
    h = doc["host"]
    sg = doc["sgemm"]
    versions = ", ".join(f"{k} {v}" for k, v in {**h["versions"], **doc["export_versions"]}.items())
    verdict = (f"**quotable**: every SGEMM ceiling of the run >= {QUOTABLE_FRACTION:.0%} of the quiet "
               f"{doc['quiet_ceiling']['gflops']:.0f} GFLOP/s ({doc['quiet_ceiling']['source']})" if doc["quotable"]
               else f"**NOT QUOTABLE**: {doc['not_quotable_because']}")
    lines = [f"# Whole models against their peers ({doc['date']})", "",
             f"{h['cpu_model']}, {h['physical_cores']} physical cores ({h['machine']}), {doc['threads']} threads for "
             f"every engine, fp32, batch 1, untuned blockforge, {doc['repeat']} interleaved samples per contender; "
             f"SGEMM ceiling {sg['before']:.0f} GFLOP/s before, {sg['after']:.0f} after (min {sg['min']:.0f}); "
             f"engines: {versions}. Command: `{doc['command']}` ({doc['wall_s']:.0f} s).", "", verdict, "",
             "| model | GFLOP | " + " | ".join(AGAINST) + " | untuned GFLOP/s | % of SGEMM | vs best peer | load |",
             "|---|---|" + "---|" * len(AGAINST) + "---|---|---|---|"]
    for m in doc["models"]:
        cells = []
        for c in AGAINST:
            x = m["contenders"].get(c)
            cells.append(f"{x['ms']['median']:.4g} ms ({x['ms']['p10']:.4g}-{x['ms']['p90']:.4g})" if x else "skipped")
        u = m["contenders"].get("untuned")
        head = m["headline"]
        ratio = f"**{head['ratio_to_best_peer']:.2f}x** ({head['best_peer']})" if head else "-"
        ld = m["load_avg_1m"]
        lines.append(f"| {m['model']} | {m['gflop']:.3g} | " + " | ".join(cells) +
                     (f" | {u['gflops']:.1f} | {u['pct_of_sgemm']:.0f}% | " if u else " | - | - | ") +
                     f"{ratio} | {ld['before']:.1f} -> {ld['after']:.1f} |")
    lines += ["", "ms: median (p10-p90). Where blockforge's time goes (`bench --profile`, untuned, % of kernel time):",
              "", "| model | " + " | ".join(KERNEL_CLASSES) + " | top kernels |", "|---|" + "---|" * (len(KERNEL_CLASSES) + 1)]
    for m in doc["models"]:
        cl = m["profile"]["classes_pct"]
        if cl is None:
            lines.append(f"| {m['model']} | " + " | ".join("-" for _ in KERNEL_CLASSES) + " | (untuned did not run) |")
            continue
        top = ", ".join(f"{k['name']} {k['pct']:.0f}%" for k in m["profile"]["top_kernels"][:3])
        lines.append(f"| {m['model']} | " + " | ".join(f"{cl[c]:.0f}%" for c in KERNEL_CLASSES) + f" | {top} |")
    if doc["failed"]:
        lines += ["", "Failed (not in the table):", "", *(f"- {f['model']}: {f['error']}" for f in doc["failed"])]
    notes = [f"- {m['model']}: {n}" for m in doc["models"] for n in m["notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    mod = load_exporter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help=f"comma list of models (default all: {','.join(mod.WHOLE)})")
    ap.add_argument("--repeat", type=int, default=20, help="timed samples per contender per model")
    ap.add_argument("--export-python", default=None, help="interpreter with torch + transformers for the exports")
    ap.add_argument("--cache-dir", default=None, help="exported models (default <blockforge cache>/whole_models)")
    ap.add_argument("--quiet-ceiling", type=float, default=None,
                    help="the quiet machine's SGEMM GFLOP/s (default: the last quiet value under --out)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--smoke", action="store_true",
                    help="the committed tiny exports, 3 samples: proves the script runs (tests/test_benchmarks.py)")
    a = ap.parse_args(argv)
    try:
        return run(a, mod)
    except UserError as e:
        print(f"whole_models.py: error: {e}", file=sys.stderr)
        return 2


def run(a, mod) -> int:
    table = mod.WHOLE
    names = list(table) if not a.only else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise UserError(f"unknown model(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(table)}")
    repeat = 3 if a.smoke else a.repeat  # 3: bench's minimum
    if repeat < 3:
        raise UserError("--repeat must be at least 3")
    out = Path(a.out)
    if a.smoke:
        quiet = (a.quiet_ceiling, "--quiet-ceiling") if a.quiet_ceiling else None
    elif a.quiet_ceiling is not None:
        quiet = (a.quiet_ceiling, "--quiet-ceiling")
    elif (quiet := last_quiet_ceiling(out)) is None:
        raise UserError(f"no quiet SGEMM ceiling under {out} (a quotable whole-models JSON or a quiet-YYYY-MM-DD/ pass): "
                        "give --quiet-ceiling GFLOPS, measured on this machine when quiet")
    cache = Path(a.cache_dir) if a.cache_dir else cache_dir() / "whole_models"
    blockforge.configure()  # TVM's pool = physical cores, as the CLI sets it
    t0 = time.time()
    host = host_facts()
    ceilings = {"before": sgemm_ceiling()}
    models, reports, export_versions, failed = [], [], {}, []
    for name in names:
        path, entry, reused = smoke_model(name) if a.smoke else cached_export(mod, name, cache, a.export_python)
        export_versions.update(entry.get("versions") or {})
        load0, t1 = os.getloadavg()[0], time.time()
        try:
            rep = bench(BenchOptions(model=path, target="host", against=AGAINST, repeat=repeat, profile=True,
                                     shape={k: tuple(v) for k, v in entry["run_inputs"].items()}))
        except BlockforgeError as e:  # one model that cannot run is a row of the table, not the end of it
            failed.append({"model": name, "error": str(e), "file_sha256": entry.get("sha256"),
                           "wall_s": round(time.time() - t1, 1)})
            print(f"{name}: FAILED: {e}", flush=True)
            continue
        row = model_row(name, entry, rep, (load0, os.getloadavg()[0]), time.time() - t1, reused)
        models.append(row)
        reports.append(rep)
        ceilings[f"{name} (before)"] = rep.sgemm_before
        ceilings[name] = rep.sgemm_gflops
        u = row["contenders"].get("untuned")
        print(f"{name}: {rep.headline_text()}; untuned {u['ms']['median']:.4g} ms" if u else f"{name}: {rep.headline_text()}",
              f"(load {load0:.1f} -> {row['load_avg_1m']['after']:.1f}, SGEMM {rep.sgemm_gflops:.0f} GFLOP/s, "
              f"{row['wall_s']:.0f} s)", flush=True)
    ceilings["after"] = sgemm_ceiling()
    low = min(ceilings.values())
    if a.smoke:
        why = "--smoke: tiny models, 3 samples; measures nothing"
    elif low < QUOTABLE_FRACTION * quiet[0]:
        worst = min(ceilings, key=ceilings.get)
        why = (f"SGEMM ceiling {low:.0f} GFLOP/s ({worst}) is below {QUOTABLE_FRACTION:.0%} of the quiet "
               f"{quiet[0]:.0f} GFLOP/s ({quiet[1]}): the machine was not quiet; discard, do not quote")
    else:
        why = None
    now = datetime.datetime.now(datetime.timezone.utc)
    node = "smoke" if a.smoke else (platform.node() or "host") + ("-not-quotable" if why else "")
    command = "benchmarks/whole_models.py " + " ".join(sys.argv[1:])
    doc = {"schema": SCHEMA, "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command, "host": host,
           "export_versions": export_versions, "threads": reports[0].threads if reports else None, "repeat": repeat,
           "against": list(AGAINST), "wall_s": round(time.time() - t0, 1),
           "sgemm": {"per_measurement": ceilings, "before": ceilings["before"], "after": ceilings["after"],
                     "min": low, "median": statistics.median(ceilings.values())},
           "quiet_ceiling": {"gflops": quiet[0], "source": quiet[1]} if quiet else None,
           "quotable": why is None, "not_quotable_because": why,
           "models": models, "failed": failed,
           "reports": {m["model"]: r.to_dict() for m, r in zip(models, reports)}}
    stem = out / f"whole-models-{node}"
    atomic_write_json(Path(f"{stem}.json"), doc)
    atomic_write_text(Path(f"{stem}.md"), markdown(doc) + "\n## Per model\n\n" +
                      "\n\n".join(f"### {m['model']}\n\n{r.markdown()}" for m, r in zip(models, reports)) + "\n")
    if reports:
        plot(reports, Path(f"{stem}.png"), labels=[m["model"] for m in models])
    print(markdown(doc))
    print(f"wrote {stem}.json/.md{'/.png' if reports else ''} ({doc['wall_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
