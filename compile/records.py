"""Tuning records as compile reads them: one database per device, applied where workloads match.

    <cache>/tuning/<device-key>/       (settings.tuning_root(); `--tuning-db DIR` picks another)
      device.json                    what device this is (refuses foreign databases)
      database_workload.json         MetaSchedule JSONDatabase files (so TVM's own tools read them)
      database_tuning_record.json
      ledger.json                    trials spent per workload, in-model A/B verdicts

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
from dataclasses import dataclass
from pathlib import Path

from blockforge import settings
from blockforge.errors import BlockforgeError, error_line
from blockforge.targets import ResolvedTarget

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


def _read_lines(path: Path, *, tolerate_torn_tail: bool) -> list[str]:
    """Complete JSON lines of `path`; a torn final line is dropped when tolerated."""
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BlockforgeError(f"{path}: unreadable tuning database file ({e})") from None
    lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    out = []
    for k, (n, line) in enumerate(lines):
        try:
            json.loads(line)
        except ValueError:
            if tolerate_torn_tail and k == len(lines) - 1:
                break  # the write a kill interrupted
            raise BlockforgeError(f"{path}: corrupt tuning database (line {n} is not JSON); "
                                  "move it aside or pass another --db") from None
        out.append(line)
    return out


@dataclass
class Contents:
    workloads: list[tuple[str, str]]  # (shash, line)
    records: list[tuple[int, str]]  # (workload index, line)

    def by_workload(self) -> dict[str, list[list]]:
        """shash -> list of run_secs lists."""
        out: dict[str, list[list]] = {}
        for idx, line in self.records:
            rec = json.loads(line)[1]
            out.setdefault(self.workloads[idx][0], []).append(rec[1] if len(rec) > 1 else None)
        return out


def read_contents(directory: Path, *, tolerate_torn_tail: bool) -> Contents:
    wl_lines = _read_lines(directory / WORKLOADS, tolerate_torn_tail=tolerate_torn_tail)
    rec_lines = _read_lines(directory / RECORDS, tolerate_torn_tail=tolerate_torn_tail)
    workloads = []
    for n, line in enumerate(wl_lines, 1):
        obj = json.loads(line)
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)):
            raise BlockforgeError(f"{directory / WORKLOADS}: line {n} is not a MetaSchedule workload "
                                  "(foreign or corrupt database)")
        workloads.append((obj[0], line))
    records = []
    for n, line in enumerate(rec_lines, 1):
        obj = json.loads(line)
        if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and isinstance(obj[1], list)):
            raise BlockforgeError(f"{directory / RECORDS}: line {n} is not a MetaSchedule tuning record "
                                  "(foreign or corrupt database)")
        if not 0 <= obj[0] < len(workloads):
            if tolerate_torn_tail and n == len(rec_lines):
                break  # its workload line was the torn one
            raise BlockforgeError(f"{directory / RECORDS}: line {n} refers to workload {obj[0]}, "
                                  f"but there are {len(workloads)} (corrupt database)")
        records.append((obj[0], line))
    return Contents(workloads, records)


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
    h = hashlib.sha256()
    for name in (WORKLOADS, RECORDS):
        p = Path(directory) / name
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()


def load_database(directory: Path, *, only: set[str] | None = None, exclude: set[str] | None = None):
    """A MetaSchedule database with the complete records of `directory` (read-only use).

    only/exclude select workloads (shash). By default the workloads whose records lost to
    blockforge's default schedule inside the whole model (ledger `prefer_default`) are left
    out, so their default schedule applies."""
    from tvm.s_tir import meta_schedule as ms

    c = read_contents(directory, tolerate_torn_tail=True)
    if exclude is None:
        exclude = {sh for sh, e in read_ledger(directory).items() if e.get("prefer_default")}
    keep = {i for i, (sh, _) in enumerate(c.workloads) if sh not in exclude and (only is None or sh in only)}
    c = Contents(c.workloads, [(i, line) for i, line in c.records if i in keep])
    tmp = Path(tempfile.mkdtemp(prefix="bf-db-"))
    try:
        (tmp / WORKLOADS).write_text("".join(line + "\n" for _, line in c.workloads))
        (tmp / RECORDS).write_text("".join(line + "\n" for _, line in c.records))
        try:
            return ms.database.JSONDatabase(work_dir=str(tmp), allow_missing=False), c
        except Exception as e:
            raise BlockforgeError(f"{directory}: MetaSchedule cannot load this database: {error_line(e, last=True)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_for_apply(target: ResolvedTarget, path: Path | None):
    """(database, info) for a build, or (None, None) when there is nothing to apply."""
    explicit = path is not None
    directory = Path(path) if explicit else default_db_dir(target)
    if not directory.exists():
        if explicit:
            raise BlockforgeError(f"{directory}: no such tuning database")
        return None, None
    if not directory.is_dir():
        raise BlockforgeError(f"{directory}: tuning database must be a directory")
    check_device(directory, target)
    db_obj, contents = load_database(directory, exclude=set())  # coverage: every record counts
    if not contents.records:
        if explicit:
            raise BlockforgeError(f"{directory}: tuning database holds no records (run `blockforge tune` "
                                  "first, or drop --tuning-db)")
        return None, None
    db_obj, _ = load_database(directory)  # what is applied: in-model losers left out
    kept = sorted(e.get("task", sh) for sh, e in read_ledger(directory).items() if e.get("prefer_default"))
    return db_obj, {"path": str(directory), "sha256": digest(directory), "records": len(contents.records),
                    "kept_default": kept}
