"""Tuning records as compile reads them: one database per device, applied where workloads match.

    <cache>/tuning/<device-key>/       (settings.tuning_root(); `--tuning-db DIR` picks another)
      device.json                    what device this is (refuses foreign databases)
      database_workload.json         MetaSchedule JSONDatabase files (so TVM's own tools read them)
      database_tuning_record.json
      ledger.json                    trials spent per workload, in-model A/B verdicts per CPU

Records are only as good as the CPU they were measured on: a record that wins inside the
model on one CPU can lose on another (the shipped x86-64-avx512 records made a BERT MHA
slower on a CPU they were not tuned on in one of two runs), and the device key (ISA +
target attributes) does not tell CPUs apart. So device.json names the CPU that tuned
(`cpu_model`, toolchain.cpu_id()) and each in-model verdict names the CPU it was made on:

    ledger[workload]["in_model"][cpu] = {"prefer_default": bool, "default_ms": .., "record_ms": ..}

When the build runs on this machine, a workload's records apply only where this CPU's
verdict says they win, or (no verdict by any CPU: tune --no-measure) where this CPU tuned
the database.
Records judged only on another CPU are left out with a warning until re-checked here with
`blockforge tune --check-only` (one build and a short A/B per tuned task; no search).
Legacy flat `prefer_default`/`in_model_ms` fields are the tuning CPU's verdict.

This is the read side, which compile needs to apply records; writing (rounds, merges,
locking, salvage) is tune's (blockforge.tune.database). Like TVM's meta_schedule.database,
the format lives apart from the drivers that fill it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from blockforge import settings
from blockforge.errors import ArgumentError, BlockforgeError, error_line, printable, raise_if_stopped
from blockforge.fsutil import dir_lock
from blockforge.targets import ResolvedTarget
from blockforge.targets.toolchain import cpu_id

from blockforge.compile.records.policy import record_problem

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
DEVICE = "device.json"
LEDGER = "ledger.json"
FORMAT = "blockforge.tuning-db/1"
FAILED_RUN_SECS = 1e9  # MetaSchedule stores 1e10 s for candidates that failed to build/run


def read_ledger(directory: Path) -> dict[str, dict]:
    p = Path(directory) / LEDGER
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except ValueError:
        return {}  # derived data: records still count (see DeviceDB.spent)
    return data if isinstance(data, dict) else {}


def compatible_key(key) -> str:
    """Device keys minus the core count: records stay valid on a machine with other cores."""
    return re.sub(r"-\d+c(?=$|-rpc-)", "", str(key))


def default_db_dir(target: ResolvedTarget, rpc_key: str | None = None) -> Path:
    """The device's database in the per-user cache: <cache>/tuning/<device-key>[-rpc-<key>]."""
    key = target.key() + (f"-rpc-{rpc_key}" if rpc_key else "")
    return settings.tuning_root() / key


SNAPSHOT_TRIES = 50  # reads of a database being replaced without a lock (no flock): retries


class _Dangling(BlockforgeError):
    """A record names a workload the workload file does not have (a read between two renames)."""


class _Changed(Exception):
    """The files changed while they were read without the lock."""


def _stamp(directory: Path) -> tuple:
    out = []
    for name in (WORKLOADS, RECORDS, LEDGER):
        try:
            st = (directory / name).stat()
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as e:
        raise BlockforgeError(f"{path}: unreadable tuning database file ({e.strerror or e})") from None


def _snapshot(directory: Path) -> tuple[dict[str, bytes], bool]:
    """The workload, record and ledger files as of one instant: read under a shared lock on
    the directory (writers rename under it exclusively: tune.database), or, where there is
    no lock, read twice-stamped and refused (_Changed) if a file was replaced meanwhile.
    Returns (bytes by file name, whether the lock was held)."""
    with dir_lock(directory, exclusive=False) as held:
        before = None if held else _stamp(directory)
        data = {name: _read_bytes(directory / name) for name in (WORKLOADS, RECORDS, LEDGER)}
        if not held and _stamp(directory) != before:
            raise _Changed
    return data, held


def _digest(data: dict[str, bytes]) -> str:
    return hashlib.sha256(data[WORKLOADS] + data[RECORDS]).hexdigest()


def _lines(path: Path, data: bytes, *, tolerate_torn_tail: bool) -> list[tuple[int, str, object]]:
    """(line number, line, parsed JSON) of the complete lines; a torn final line is dropped when tolerated."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BlockforgeError(f"{path}: unreadable tuning database file ({e})") from None
    lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    out = []
    for k, (n, line) in enumerate(lines):
        try:
            obj = json.loads(line)
        except ValueError:
            if tolerate_torn_tail and k == len(lines) - 1:
                break  # the write a kill interrupted
            raise BlockforgeError(f"{path}: corrupt tuning database (line {n} is not JSON); "
                                  "move it aside or use another tuning database") from None
        out.append((n, line, obj))
    return out


@dataclass(frozen=True)
class Refusal:
    """A record that failed record_policy (or that MetaSchedule cannot replay): kept in the
    files, never applied nor given to TVM's search."""
    line: int  # its line in database_tuning_record.json
    workload: str  # its workload's shash
    text: str  # the line as it was
    reason: str


@dataclass
class Contents:
    workloads: list[tuple[str, str]]  # (shash, line)
    records: list[tuple[int, str]]  # (workload index, line): the records that may be applied
    refused: list[Refusal] = field(default_factory=list)
    sha256: str = ""  # of the workload and record files these contents were read from
    ledger: dict = field(default_factory=dict)  # ledger.json as of the same instant
    path: Path | None = None
    linenos: list[int] = field(default_factory=list)  # each record's line in the file

    def by_workload(self) -> dict[str, list[list]]:
        """shash -> list of run_secs lists."""
        out: dict[str, list[list]] = {}
        for idx, line in self.records:
            rec = json.loads(line)[1]
            out.setdefault(self.workloads[idx][0], []).append(rec[1] if len(rec) > 1 else None)
        return out

    def _task(self, r: Refusal) -> str | None:
        entry = self.ledger.get(r.workload)
        return entry.get("task") if isinstance(entry, dict) and isinstance(entry.get("task"), str) else None

    def refused_tasks(self) -> list[str]:
        """Tasks (by the ledger's names) that have refused records and no applicable one."""
        ok = {self.workloads[i][0] for i, _ in self.records}
        return sorted({t for r in self.refused if r.workload not in ok and (t := self._task(r))})

    def warnings(self) -> list[str]:
        """One line per refused record, naming it (file, line, task)."""
        out = []
        for r in self.refused:
            sh, task = r.workload, self._task(r)
            line = (f"tuning record {self.path / RECORDS if self.path else RECORDS} line {r.line} "
                    f"({f'task {task[:80]}' if task else f'workload {sh[:40]}'}) refused: {r.reason}; not applied")
            out.append(printable(line, None))  # the names come from the file: one line each
        return out


def _parse(directory: Path, data: dict[str, bytes], tolerate_torn_tail: bool) -> Contents:
    wl_lines = _lines(directory / WORKLOADS, data[WORKLOADS], tolerate_torn_tail=tolerate_torn_tail)
    rec_lines = _lines(directory / RECORDS, data[RECORDS], tolerate_torn_tail=tolerate_torn_tail)
    workloads = []
    for n, (_, line, obj) in enumerate(wl_lines, 1):
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)):
            raise BlockforgeError(f"{directory / WORKLOADS}: line {n} is not a MetaSchedule workload "
                                  "(foreign or corrupt database)")
        workloads.append((obj[0], line))
    records, refused, linenos = [], [], []
    for n, (lineno, line, obj) in enumerate(rec_lines, 1):
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], list)):
            raise BlockforgeError(f"{directory / RECORDS}: line {n} is not a MetaSchedule tuning record "
                                  "(foreign or corrupt database)")
        if not 0 <= obj[0] < len(workloads):
            if tolerate_torn_tail and n == len(rec_lines):
                break  # its workload line was the torn one
            raise _Dangling(f"{directory / RECORDS}: line {n} refers to workload {obj[0]}, "
                            f"but there are {len(workloads)} (corrupt database)")
        problem = record_problem(obj[1])
        if problem:
            refused.append(Refusal(lineno, workloads[obj[0]][0], line, problem))
        else:
            records.append((obj[0], line))
            linenos.append(lineno)
    ledger = {}
    if data[LEDGER]:
        try:
            ledger = json.loads(data[LEDGER])
        except ValueError:
            pass  # derived data: records still count (see DeviceDB.spent)
    return Contents(workloads, records, refused, _digest(data), ledger if isinstance(ledger, dict) else {},
                    Path(directory), linenos)


def read_contents(directory: Path, *, tolerate_torn_tail: bool) -> Contents:
    """The database as of one instant (every reader comes through here): its records
    checked against record_policy, the refused ones set apart, and the digest and ledger
    of the same files."""
    directory = Path(directory)
    for attempt in range(SNAPSHOT_TRIES):
        try:
            data, held = _snapshot(directory)
            return _parse(directory, data, tolerate_torn_tail)
        except _Changed:
            pass
        except _Dangling:
            if held or attempt == SNAPSHOT_TRIES - 1:
                raise  # under the lock a dangling index is real damage
        time.sleep(0.005)
    raise BlockforgeError(f"{directory}: the tuning database kept changing while it was read; try again")


def check_device(directory: Path, target: ResolvedTarget | None) -> dict | None:
    """The database's device description (None for a plain MetaSchedule database);
    refuses a foreign or other-device database."""
    dev = Path(directory) / DEVICE
    if not dev.exists():
        return None
    try:
        info = json.loads(dev.read_text())
    except (OSError, ValueError):
        raise BlockforgeError(f"{dev}: corrupt device description") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise BlockforgeError(f"{directory}: not a blockforge tuning database (foreign {DEVICE})")
    if target is not None and compatible_key(info.get("key")) != compatible_key(target.key()):
        raise BlockforgeError(f"{directory}: database is for device {info.get('key')!r}, "
                              f"not {target.key()!r}; pick the matching database")
    return info


def is_database(directory: Path) -> bool:
    """Whether `directory` holds a tuning database (ours, or MetaSchedule's plain files)."""
    d = Path(directory)
    return any((d / f).is_file() for f in (DEVICE, WORKLOADS, RECORDS))


def digest(directory: Path) -> str:
    """sha256 of the workload and record files as of one instant (what compile's manifest names)."""
    for _ in range(SNAPSHOT_TRIES):
        try:
            return _digest(_snapshot(Path(directory))[0])
        except _Changed:
            time.sleep(0.005)
    raise BlockforgeError(f"{directory}: the tuning database kept changing while it was read; try again")


UNKNOWN_CPU = "unknown CPU"


def verdicts(entry: dict, db_cpu: str | None) -> dict[str, dict]:
    """A workload's in-model verdicts by CPU; the legacy flat fields count as the tuning CPU's."""
    out = {}
    if "prefer_default" in entry:
        ms = entry.get("in_model_ms") or {}
        out[db_cpu or UNKNOWN_CPU] = {"prefer_default": bool(entry["prefer_default"]),
                                      "default_ms": ms.get("default"), "record_ms": ms.get("record")}
    by_cpu = entry.get("in_model")
    if isinstance(by_cpu, dict):
        out.update({str(k): v for k, v in by_cpu.items() if isinstance(v, dict)})
    return out


def read_device(directory: Path) -> dict:
    try:
        info = json.loads((Path(directory) / DEVICE).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


@dataclass
class ApplyPlan:
    """Which workloads' records a build on `cpu` leaves out, and why (task names)."""
    cpu: str | None  # None: the build does not run here (cross/GPU): the tuning CPU's verdicts rule
    db_cpu: str | None
    exclude: set[str]
    kept_default: list[str]  # a verdict (this CPU's, or the tuning CPU's) kept the default schedule
    unvalidated: list[str]  # records judged on another CPU only, not re-checked on this one
    verdict_cpus: list[str]  # the CPUs whose verdicts the skipped records carry


def plan_apply(directory: Path, cpu: str | None, contents: Contents | None = None) -> ApplyPlan:
    """Leave out records whose in-model verdict prefers the default schedule, and (when the
    build runs on `cpu`) records no verdict of this CPU vouches for: those judged on another
    CPU, and unjudged ones (tune --no-measure) unless this CPU tuned the database."""
    db_cpu = read_device(directory).get("cpu_model")
    c = contents or read_contents(Path(directory), tolerate_torn_tail=True)
    ledger = c.ledger  # as of the same instant as the records
    with_records = {c.workloads[i][0] for i, _ in c.records}
    exclude, kept, unvalidated, others = set(), [], [], set()
    for sh in sorted(with_records):
        entry = ledger.get(sh, {})
        v = verdicts(entry, db_cpu)
        name = entry.get("task", sh)
        mine = v.get(cpu) if cpu is not None else v.get(db_cpu or UNKNOWN_CPU)
        if mine is not None:
            if mine.get("prefer_default"):
                exclude.add(sh)
                kept.append(name)
        elif cpu is not None and (db_cpu != cpu or v):  # judged elsewhere only, or tuned elsewhere
            exclude.add(sh)
            unvalidated.append(name)
            others.update(v or [db_cpu or UNKNOWN_CPU])
    return ApplyPlan(cpu, db_cpu, exclude, sorted(kept), sorted(unvalidated), sorted(others))


def load_database(directory: Path, *, only: set[str] | None = None, exclude: set[str] | None = None,
                  cpu: str | None = None, contents: Contents | None = None):
    """A MetaSchedule database with the complete, policy-checked records of `directory`
    (read-only use; `contents`: a snapshot already read, so what is applied is what was read).

    only/exclude select workloads (shash). By default the workloads plan_apply(cpu) leaves
    out are excluded: records that lost to blockforge's default schedule inside the whole
    model, and (for a build that runs on `cpu`) records no verdict of that CPU vouches for.
    Refused records (record_policy) never reach TVM; records MetaSchedule cannot replay
    are refused too (in the returned contents' `refused`)."""
    c = contents or read_contents(directory, tolerate_torn_tail=True)
    if exclude is None:
        exclude = plan_apply(directory, cpu, c).exclude
    picked = [k for k, (i, _) in enumerate(c.records)
              if c.workloads[i][0] not in exclude and (only is None or c.workloads[i][0] in only)]
    c = _subset(c, picked)
    try:
        return _ms_database(c), c
    except Exception as e:
        first = error_line(e, last=True)
    # MetaSchedule replays every trace as it loads and fails the whole database on one it
    # cannot replay (policy-valid, but not a schedule of its workload): find those one by
    # one, refuse them like any other, and load the rest.
    unreplayable = []
    for k, (i, line) in enumerate(c.records):
        try:
            _ms_database(_subset(c, [k]))
        except Exception as e:
            raise_if_stopped()  # TVM turns a Ctrl-C inside it into a RuntimeError
            cause = error_line(e, last=True, limit=120)
            # TVM's own error for a schedule step that does not apply says only
            # "parallel_for_dynamic error with (not rendered)"
            cause = type(e).__name__ if "not rendered" in cause else cause
            unreplayable.append(Refusal(c.linenos[k] if c.linenos else 0, c.workloads[i][0], line,
                                        f"MetaSchedule cannot replay it on its workload ({cause}: its schedule "
                                        "does not apply there)"))
    if not unreplayable:
        raise BlockforgeError(f"{directory}: MetaSchedule cannot load this database: {first}") from None
    bad = {r.text for r in unreplayable}
    c = _subset(c, [k for k, (_, line) in enumerate(c.records) if line not in bad])
    c.refused = c.refused + unreplayable
    try:
        return _ms_database(c), c
    except Exception as e:
        raise BlockforgeError(f"{directory}: MetaSchedule cannot load this database: {error_line(e, last=True)}") from None


def _subset(c: Contents, picked: list[int]) -> Contents:
    """Contents with only the records at positions `picked` and the workloads they name,
    renumbered (the refused records, digest and ledger stay). Workloads without a record go:
    MetaSchedule's has_workload is what compile's coverage report counts as "applied"."""
    keep = sorted({c.records[k][0] for k in picked})
    index = {old: new for new, old in enumerate(keep)}
    records = []
    for k in picked:
        obj = json.loads(c.records[k][1])
        obj[0] = index[obj[0]]
        records.append((obj[0], json.dumps(obj, separators=(",", ":"))))
    return Contents([c.workloads[i] for i in keep], records, list(c.refused), c.sha256, c.ledger, c.path,
                    [c.linenos[k] for k in picked] if c.linenos else [])


def _ms_database(c: Contents):
    """A MetaSchedule JSONDatabase of exactly `c` (loaded from a private temporary copy)."""
    from tvm.s_tir import meta_schedule as ms

    tmp = Path(tempfile.mkdtemp(prefix="bf-db-"))
    try:
        (tmp / WORKLOADS).write_text("".join(line + "\n" for _, line in c.workloads))
        (tmp / RECORDS).write_text("".join(line + "\n" for _, line in c.records))
        return ms.database.JSONDatabase(work_dir=str(tmp), allow_missing=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def apply_cpu(target: ResolvedTarget) -> str | None:
    """The CPU a build's records must be vouched for on: this one, when the build runs on it."""
    return cpu_id() if target.device == "cpu" and target.run_problem() is None else None


def open_for_apply(target: ResolvedTarget, path: Path | None):
    """(database, info) for a build, or (None, None) when there is nothing to apply.

    info["unvalidated"] names the tasks whose records were left out because only another
    CPU judged them (callers warn: see unvalidated_warning); info["refused"] has one line
    per record record_policy refused (callers warn with each). Everything (records, ledger,
    the sha256 the manifest records) comes from one snapshot of the files."""
    explicit = path is not None
    directory = Path(path) if explicit else default_db_dir(target)
    if not directory.exists():
        if explicit:
            raise BlockforgeError(f"{directory}: no such tuning database")
        return None, None
    if not directory.is_dir():
        raise BlockforgeError(f"{directory}: tuning database must be a directory")
    check_device(directory, target)
    contents = read_contents(directory, tolerate_torn_tail=True)
    if not contents.records and not contents.refused:
        if explicit:
            raise ArgumentError(f"{directory}: tuning database holds no records (run `blockforge tune` "
                                "first, or drop {tuning_db})", "tuning_db")
        return None, None
    plan = plan_apply(directory, apply_cpu(target), contents)
    db_obj, applied = load_database(directory, exclude=plan.exclude, contents=contents)  # what is applied
    return db_obj, {"path": str(directory), "sha256": contents.sha256, "records": len(contents.records),
                    "kept_default": plan.kept_default, "unvalidated": plan.unvalidated, "cpu": plan.cpu,
                    "verdict_cpus": plan.verdict_cpus, "refused": applied.warnings(),
                    "refused_tasks": applied.refused_tasks()}


def unvalidated_warning(info: dict, tasks: list[str], target_name: str) -> str | None:
    """One line for the tasks of this build whose records were skipped as judged on another CPU."""
    if not info or not tasks:
        return None
    return (f"tuning records for {', '.join(tasks)} were validated on {' / '.join(info['verdict_cpus'])}, "
            f"not this CPU ({info['cpu']}): skipped (default schedules used). Re-check them here: "
            f"blockforge tune MODEL --target {target_name} --tuning-db {info['path']} --check-only")
