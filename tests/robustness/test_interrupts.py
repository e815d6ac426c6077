"""SIGINT and SIGTERM end every verb cleanly, at several moments of its work.

Each case starts the CLI as a terminal would (its own process group, start_new_session),
waits for a moment of the run (a child process appearing or gone, a file, a line on
stdout, or a delay after one of those), sends the signal to the whole group (as a
terminal's Ctrl-C does) or to the blockforge process alone (as `kill PID` or a timeout
does: then blockforge itself must end its children), and checks:

  * exit 130 (SIGINT) / 143 (SIGTERM), one `blockforge:` line on stderr, no traceback;
  * no process of the run left (worker pools, RPC workers, the isolated-import child,
    compilers), orphans included: every process of the session is checked;
  * nothing left in the run's TMPDIR (TVM's tmp*/lib0.o, candidate exports);
  * no partial output: nothing at the destination, no hidden `.NAME.*.tmp` sibling;
  * tune: the database loads, keeps its records, and its lock is free.

Count of cases: len(CASES) + 1 (test_case_count_for_readme prints the figures the README quotes;
`make robustness` reruns them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import pytest

from conftest import BLOCKFORGE, compiled_ffn, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.isolation]  # the isolation child is under test too
SHAPE = "batch=1,seq=8"
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
LINE = {signal.SIGINT: "blockforge: interrupted", signal.SIGTERM: "blockforge: terminated"}


# ---------------------------------------------------------------- moments

@dataclass
class Run:
    proc: subprocess.Popen
    dir: Path
    t0: float = field(default_factory=time.monotonic)

    def descendants(self) -> list[str]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for k in kids:
            try:
                out.append(" ".join(k.cmdline()))
            except psutil.Error:
                pass
        return out

    def stdout(self) -> str:
        return (self.dir / "out").read_text()


Moment = Callable[[Run], bool]


def started(r: Run) -> bool:
    """main() is running: its handlers are installed and it has opened the log."""
    return (r.dir / "log").exists()


def child(fragment: str) -> Moment:
    return lambda r: any(fragment in c for c in r.descendants())


def child_done(fragment: str) -> Moment:
    """The child appeared and has ended since."""
    seen = []

    def m(r: Run) -> bool:
        here = any(fragment in c for c in r.descendants())
        if here:
            seen.append(1)
        return bool(seen) and not here
    return m


def exists(rel: str) -> Moment:
    """A file (or a glob: phase dumps are numbered by the phases before them) has appeared."""
    return lambda r: any(r.dir.glob(rel)) if any(c in rel for c in "*?[") else (r.dir / rel).exists()


def printed(text: str) -> Moment:
    return lambda r: text in r.stdout()


def then(first: Moment, delay_s: float) -> Moment:
    """`delay_s` seconds after `first` became true."""
    at = []

    def m(r: Run) -> bool:
        if not at and first(r):
            at.append(time.monotonic())
        return bool(at) and time.monotonic() - at[0] >= delay_s
    return m


ISOLATE = "blockforge.compile.isolate"
WORKER = "tvm.exec.popen_worker"


# ---------------------------------------------------------------- the harness

def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


@dataclass
class Ended:
    rc: int
    out: str
    err: str
    left_tmp: list[str]
    left_procs: list[str]
    moment_s: float


def interrupt(d: Path, args: list, sig: int, moment: Moment, *, group: bool = True, limit_s: float = 240) -> Ended:
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "BLOCKFORGE_LOG": str(d / "log")}
    with open(d / "out", "w") as out, open(d / "err", "w") as err:
        p = subprocess.Popen([*BLOCKFORGE, *map(str, args)], cwd=d, env=env, stdout=out, stderr=err,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    r = Run(p, d)
    try:
        while not moment(r):
            assert p.poll() is None, f"ended (rc {p.returncode}) before the moment:\n{(d / 'err').read_text()}"
            assert time.monotonic() - r.t0 < limit_s, "the moment never came"
            time.sleep(0.01)
        at = time.monotonic() - r.t0
        if group:
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
        p.wait(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + 10  # the group's own children die on their way out too
    while _session(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for q in _session(p.pid):
        try:
            left.append(f"{q.pid} {' '.join(q.cmdline())[:120]}")
        except psutil.Error:
            pass
        q.kill()  # never leave a stray process behind a failing test
    return Ended(p.returncode, (d / "out").read_text(), (d / "err").read_text(),
                 sorted(str(x.relative_to(tmp)) for x in tmp.rglob("*")), left, at)


def assert_stopped(e: Ended, sig: int) -> None:
    assert e.rc == EXIT[sig], f"rc {e.rc} (moment {e.moment_s:.1f} s)\n{e.err}"
    assert "Traceback" not in e.err + e.out, e.err
    lines = [ln for ln in e.err.splitlines() if ln.strip()]
    assert lines and lines[-1] == LINE[sig], e.err
    assert all(ln.startswith("warning:") for ln in lines[:-1]), e.err
    assert not e.left_procs, f"processes left: {e.left_procs}"
    assert not e.left_tmp, f"left in TMPDIR: {e.left_tmp}"


def no_partial(dest: Path) -> None:
    """Nothing at `dest` and no hidden temporary sibling of it."""
    assert not dest.exists(), f"{dest} exists after the interrupt"
    strays = [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]
    assert not strays, f"temporary files left beside {dest}: {strays}"


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return compiled_ffn(tmp_path_factory.mktemp("interrupts"), d_model=32, seq=8)


def _tune_args(b, db: Path) -> list:
    return ["tune", b["model"], "--target", "host", "--shape", SHAPE, "--db", db, "--no-progress", "--no-measure",
            "--trials-per-task", 8, "--round-trials", 2, "--population", 32]  # the stop is under test, not the search


def _db_checks(db: Path, min_records: int) -> None:
    from filelock import FileLock

    from blockforge.compile.records.reader import load_database, read_contents

    records = read_contents(db, tolerate_torn_tail=False).records if (db / "database_tuning_record.json").exists() \
        else []
    assert len(records) >= min_records, f"{len(records)} records left"
    if records:
        load_database(db)  # MetaSchedule loads what the interrupt left
    assert not (db / ".lock.owner").exists(), "the lock's owner file stayed"
    with FileLock(str(db / ".lock"), timeout=0):  # the lock is free
        pass
    rounds = [p.name for p in (db / "scratch").iterdir() if p.is_dir()] if (db / "scratch").is_dir() else []
    assert not rounds, f"scratch rounds not salvaged: {rounds}"


# ---------------------------------------------------------------- the cases
# (name, args(base, dir) -> list, signal, moment, to the group?, extra check(base, dir, ended))

def _export_check(b, d, e):
    files = sorted(p.name for p in (d / "o").iterdir()) if (d / "o").exists() else []
    assert files in ([], ["m.json", "m.onnx"]), f"export left {files}: both or neither"


def _compile_check(b, d, e):
    no_partial(d / "art")


def _tune_first_merge_check(b, d, e):
    _db_checks(d / "db", min_records=1)


CASES = [
    ("export SIGINT at start", lambda b, d: ["export", "ffn", "--d-model", 64, "-o", d / "o" / "m.onnx"],
     signal.SIGINT, started, True, _export_check),
    # 128 MiB of weights: 4.3 s on Zen 5 (the 32 MiB of d_model 1024 took 1.5 s there, and a clean-clone CI's
    # export was done before the signal at 1.1 s)
    ("export SIGTERM while building", lambda b, d: ["export", "ffn", "--d-model", 2048, "-o", d / "o" / "m.onnx"],
     signal.SIGTERM, then(started, 0.5), False, _export_check),
    ("inspect SIGINT in the isolated check", lambda b, d: ["inspect", b["model"]],
     signal.SIGINT, child(ISOLATE), True, None),
    ("verify SIGTERM (process only) in the isolated check", lambda b, d: ["verify", b["model"], "--shape", SHAPE],
     signal.SIGTERM, child(ISOLATE), False, None),
    ("compile SIGINT in the isolated check",
     lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE, "-o", d / "art"],
     signal.SIGINT, child(ISOLATE), True, _compile_check),
    # --dump-ir writes each phase as it ends: legalize written = the schedule phase runs, whose
    # Python rules TVM calls back (a KeyboardInterrupt there reaches us as RuntimeError(''))
    ("compile SIGTERM in the schedule phase",
     lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE, "-o", d / "art", "--dump-ir", d / "ir"],
     signal.SIGTERM, exists("ir/*-legalize.py"), True, _compile_check),
    ("compile SIGTERM (process only) while linking module.so",
     lambda b, d: ["compile", b["model"], "--target", "host", "--shape", SHAPE, "-o", d / "art"],
     signal.SIGTERM, child("g++"), False, _compile_check),
    # As soon as main() runs: the tiny artifact's whole run (load, hash, call, write) takes under
    # 0.3 s after the log opens on a Zen 5 core (the clean-clone CI run of d072829 saw it end
    # first, rc 0), so a fixed delay raced the verb's own end.
    ("run SIGINT as it starts", lambda b, d: ["run", b["art"], "--inputs", b["inputs"], "--output", d / "o.npz"],
     signal.SIGINT, started, True, lambda b, d, e: no_partial(d / "o.npz")),
    ("tune SIGTERM (process only) after the first merge", lambda b, d: _tune_args(b, d / "db"),
     signal.SIGTERM, then(exists("db/database_tuning_record.json"), 0.5), False, _tune_first_merge_check),
    ("bench SIGTERM (process only) while timing",
     lambda b, d: ["bench", b["model"], "--shape", SHAPE, "--repeat", 200, "--json", d / "b.json"],
     signal.SIGTERM, then(child_done(ISOLATE), 4.0), False,  # 200 interleaved samples: >= 6 s of timing
     lambda b, d, e: no_partial(d / "b.json")),
    ("package SIGTERM while packaging", lambda b, d: ["package", b["art"], "-o", d / "pkg"],
     signal.SIGTERM, started, False, lambda b, d, e: no_partial(d / "pkg")),
    ("rpc server SIGTERM (process only) during startup",
     lambda b, d: ["rpc", "server", "--tracker", "127.0.0.1:9", "--key", "k", "--port", 0],
     signal.SIGTERM, then(started, 0.3), False, None),
    ("rpc server SIGINT when serving",
     lambda b, d: ["rpc", "server", "--tracker", "127.0.0.1:9", "--key", "k", "--port", 0],
     signal.SIGINT, printed("RPC server on"), True, None),
    ("rpc tracker on 127.0.0.2 SIGTERM (process only) when serving",
     lambda b, d: ["rpc", "tracker", "--host", "127.0.0.2", "--port", 0],
     signal.SIGTERM, printed("RPC tracker on"), False,
     lambda b, d, e: re.search(r"RPC tracker on 127\.0\.0\.2:([1-9]\d*) ", e.out) or pytest.fail(e.out)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interrupt(case, base, tmp_path):
    name, args, sig, moment, group, check = case
    e = interrupt(tmp_path, args(base, tmp_path), sig, moment, group=group)
    assert_stopped(e, sig)
    if check:
        check(base, tmp_path, e)


def test_second_signal_does_not_break_the_cleanup(base, tmp_path):
    """tune: Ctrl-C to the group while the builder workers run, then SIGTERM to blockforge
    50 ms later: the first signal decides, and its cleanup still finishes."""
    workers = then(child(WORKER), 0.3)

    def twice(r: Run) -> bool:
        if not workers(r):
            return False
        os.killpg(r.proc.pid, signal.SIGINT)  # the first: Ctrl-C; the harness sends SIGTERM next
        time.sleep(0.05)
        return True
    e = interrupt(tmp_path, _tune_args(base, tmp_path / "db"), signal.SIGTERM, twice, group=False)
    # the first signal decides the exit; the second only must not cut the cleanup short
    assert e.rc == 130, e.err
    assert "Traceback" not in e.err and e.err.strip().splitlines()[-1] == LINE[signal.SIGINT], e.err
    assert not e.left_procs and not e.left_tmp, (e.left_procs, e.left_tmp)
    _db_checks(tmp_path / "db", min_records=0)


def test_rpc_port_checks(tmp_path):
    r = run_cli("rpc", "tracker", "--port", 70000, cwd=tmp_path)
    assert r.rc == 2 and "out of range" in r.err and "Traceback" not in r.text, r.text


def test_case_count_for_readme():
    """The README's robustness table quotes these figures."""
    verbs = {c[1]({"model": "m", "art": "a", "inputs": "i"}, Path("d"))[0] for c in CASES}
    # + test_second_signal_does_not_break_the_cleanup (tune)
    print(json.dumps({"cases": len(CASES) + 1, "verbs": sorted(verbs),
                      "signals": {"SIGINT": sum(c[2] == signal.SIGINT for c in CASES) + 1,
                                  "SIGTERM": sum(c[2] == signal.SIGTERM for c in CASES)},
                      "to the process only": sum(not c[4] for c in CASES)}))
    assert verbs >= {"export", "inspect", "verify", "compile", "run", "tune", "bench", "package", "rpc"}
