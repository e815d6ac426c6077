"""Tuning databases, one per device, safe against kill -9 and shared across models.

    artifacts/tuning/<device-key>/
      device.json                    what device this is (refuses foreign databases)
      database_workload.json         MetaSchedule JSONDatabase files (so TVM's own tools read them)
      database_tuning_record.json
      ledger.json                    trials spent per workload (resume, budgets)
      scratch/<job>-<round>/         rounds in flight; salvaged by the next job
      tune.log                       TVM's logs

MetaSchedule's JSONDatabase appends lines without fsync and refuses to load a torn line.
blockforge never lets TVM write the device files: each round tunes into a scratch copy,
then the new records are merged into fresh files that replace the old ones atomically
(workloads first: they are append-only, so record indices stay valid at every instant).
A torn last line of a scratch file (the kill landed mid-write) is dropped; every complete
line is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blockforge.errors import BlockforgeError, error_line
from blockforge.fsutil import atomic_write_json, atomic_write_text
from blockforge.targets import ResolvedTarget

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
DEVICE = "device.json"
LEDGER = "ledger.json"
FORMAT = "blockforge.tuning-db/1"
FAILED_RUN_SECS = 1e9  # MetaSchedule stores 1e10 s for candidates that failed to build/run


def _read_ledger(directory: Path) -> dict[str, dict]:
    p = Path(directory) / LEDGER
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except ValueError:
        return {}  # derived data: records still count (see DeviceDB.spent)
    return data if isinstance(data, dict) else {}


def _compatible(key) -> str:
    """Device keys minus the core count: records stay valid on a machine with other cores."""
    import re

    return re.sub(r"-\d+c(?=$|-rpc-)", "", str(key))


def default_db_dir(target: ResolvedTarget, rpc_key: str | None = None) -> Path:
    key = target.key() + (f"-rpc-{rpc_key}" if rpc_key else "")
    return Path("artifacts") / "tuning" / key


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


class DeviceDB:
    """The device database directory, used under `lock()` for writing."""

    def __init__(self, path: Path, target: ResolvedTarget | None = None, *, create: bool = False):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise BlockforgeError(f"{self.path}: tuning database must be a directory")
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise BlockforgeError(f"{self.path}: no such tuning database")
        self._check_device(target, create)

    # -- identity ---------------------------------------------------------------
    def _check_device(self, target: ResolvedTarget | None, create: bool) -> None:
        dev = self.path / DEVICE
        if dev.exists():
            try:
                info = json.loads(dev.read_text())
            except ValueError:
                raise BlockforgeError(f"{dev}: corrupt device description") from None
            if not isinstance(info, dict) or info.get("format") != FORMAT:
                raise BlockforgeError(f"{self.path}: not a blockforge tuning database (foreign {DEVICE})")
            if target is not None and _compatible(info.get("key")) != _compatible(target.key()):
                raise BlockforgeError(f"{self.path}: database is for device {info.get('key')!r}, "
                                      f"not {target.key()!r}; pick the matching --db")
        elif any((self.path / f).exists() for f in (WORKLOADS, RECORDS)) and not create:
            pass  # a plain MetaSchedule database: usable for applying
        elif create and target is not None:
            atomic_write_json(dev, {"format": FORMAT, "key": target.key(), "target": target.target_json})

    # -- reading ----------------------------------------------------------------
    def contents(self) -> Contents:
        return read_contents(self.path, tolerate_torn_tail=False)

    def ledger(self) -> dict[str, dict]:
        return _read_ledger(self.path)

    def set_ledger_flag(self, shash: str, key: str, value) -> None:
        led = self.ledger()
        led.setdefault(shash, {"trials": 0})[key] = value
        try:
            atomic_write_json(self.path / LEDGER, led)
        except OSError as e:
            raise BlockforgeError(f"cannot write tuning ledger {self.path / LEDGER}: {e.strerror or e}") from None

    def spent(self, shash: str, contents: Contents | None = None) -> int:
        """Trials spent on a workload: the ledger, or its records (minus the default-schedule
        seed, which is not a search trial) where a lost ledger update undercounts."""
        c = contents or self.contents()
        entry = self.ledger().get(shash, {})
        recs = len(c.by_workload().get(shash, [])) - (1 if entry.get("seeded") else 0)
        return max(recs, int(entry.get("trials", 0)))

    def digest(self) -> str:
        h = hashlib.sha256()
        for name in (WORKLOADS, RECORDS):
            p = self.path / name
            h.update(p.read_bytes() if p.exists() else b"")
        return h.hexdigest()

    # -- writing ----------------------------------------------------------------
    def merge(self, scratch: Path, skip_records: int = 0) -> dict[str, int]:
        """Merge complete records of a scratch database (after its first `skip_records`,
        which were copied from here) into the device files. Returns records added per workload."""
        new = read_contents(scratch, tolerate_torn_tail=True)
        cur = self.contents()
        index = {sh: i for i, (sh, _) in enumerate(cur.workloads)}
        workloads = list(cur.workloads)
        added: dict[str, int] = {}
        new_records = []
        for idx, line in new.records[skip_records:]:
            sh, wline = new.workloads[idx]
            if sh not in index:
                index[sh] = len(workloads)
                workloads.append((sh, wline))
            obj = json.loads(line)
            obj[0] = index[sh]
            new_records.append(json.dumps(obj, separators=(",", ":")))
            added[sh] = added.get(sh, 0) + 1
        if not new_records:
            return {}
        try:
            atomic_write_text(self.path / WORKLOADS, "".join(line + "\n" for _, line in workloads))
            atomic_write_text(self.path / RECORDS, "".join(line + "\n" for _, line in cur.records)
                              + "".join(line + "\n" for line in new_records))
        except OSError as e:
            raise BlockforgeError(f"cannot write tuning database {self.path}: {e.strerror or e}; "
                                  "its previous contents are intact") from None
        return added

    def add_to_ledger(self, trials: dict[str, int], names: dict[str, str]) -> None:
        if not trials:
            return
        led = self.ledger()
        for sh, n in trials.items():
            entry = led.setdefault(sh, {"trials": 0})
            entry["trials"] = int(entry.get("trials", 0)) + n
            if sh in names:
                entry["task"] = names[sh]
        try:
            atomic_write_json(self.path / LEDGER, led)
        except OSError as e:
            raise BlockforgeError(f"cannot write tuning ledger {self.path / LEDGER}: {e.strerror or e}") from None

    def mark_seeded(self, shash: str, name: str) -> None:
        self.set_ledger_flag(shash, "seeded", True)
        self.set_ledger_flag(shash, "task", name)

    def scratch_dir(self, job: str, n: int) -> Path:
        d = self.path / "scratch" / f"{job}-{n}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def salvage(self) -> dict[str, int]:
        """Merge what killed jobs left in scratch/, then remove it. Call under the lock."""
        total: dict[str, int] = {}
        root = self.path / "scratch"
        if not root.is_dir():
            return total
        for d in sorted(root.iterdir()):
            skip = 0
            marker = d / "copied_records"
            if marker.exists():
                try:
                    skip = int(marker.read_text().strip() or 0)
                except ValueError:
                    skip = 0
            try:
                added = self.merge(d, skip)
            except BlockforgeError:
                added = {}  # a scratch dir we cannot read holds nothing we can trust
            for sh, n in added.items():
                total[sh] = total.get(sh, 0) + n
            shutil.rmtree(d, ignore_errors=True)
        self.add_to_ledger(total, {})
        return total

    def lock(self):
        return _Lock(self.path)

    def export_best(self, dest: Path, top_k: int = 1) -> int:
        """Write a small database with the best `top_k` records per workload (to ship)."""
        c = self.contents()
        best: dict[int, list] = {}
        for idx, line in c.records:
            rs = json.loads(line)[1][1] or [FAILED_RUN_SECS * 10]
            best.setdefault(idx, []).append((sum(rs) / len(rs), line))
        keep = sorted(idx for idx in best)
        remap = {old: new for new, old in enumerate(keep)}
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        records = []
        for idx in keep:
            for _, line in sorted(best[idx])[:top_k]:
                obj = json.loads(line)
                obj[0] = remap[idx]
                records.append(json.dumps(obj, separators=(",", ":")))
        for name in (DEVICE, LEDGER):
            if (self.path / name).exists():
                shutil.copyfile(self.path / name, dest / name)
        atomic_write_text(dest / WORKLOADS, "".join(c.workloads[i][1] + "\n" for i in keep))
        atomic_write_text(dest / RECORDS, "".join(r + "\n" for r in records))
        return len(records)


class _Lock:
    """An exclusive, non-blocking lock on the database; the holder is written beside it."""

    def __init__(self, path: Path):
        from filelock import FileLock

        self.path = path
        self.owner = path / ".lock.owner"
        self._lock = FileLock(str(path / ".lock"), timeout=0)

    def __enter__(self):
        from filelock import Timeout

        try:
            self._lock.acquire()
        except Timeout:
            try:
                who = json.loads(self.owner.read_text())
                desc = f"pid {who['pid']} on {who['host']} (started {who['started']}: {who['command']})"
            except (OSError, ValueError, KeyError):
                desc = "another process"
            raise BlockforgeError(f"tuning database {self.path} is in use by {desc}; "
                                  "wait for it to finish or use another --db") from None
        atomic_write_json(self.owner, {"pid": os.getpid(), "host": socket.gethostname(),
                                       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "command": " ".join(os.sys.argv)[:200]})
        return self

    def __exit__(self, *exc):
        try:
            self.owner.unlink()
        except OSError:
            pass
        self._lock.release()


def load_database(directory: Path, *, only: set[str] | None = None, exclude: set[str] | None = None):
    """A MetaSchedule database with the complete records of `directory` (read-only use).

    only/exclude select workloads (shash). By default the workloads whose records lost to
    blockforge's default schedule inside the whole model (ledger `prefer_default`) are left
    out, so their default schedule applies."""
    from tvm.s_tir import meta_schedule as ms

    c = read_contents(directory, tolerate_torn_tail=True)
    if exclude is None:
        exclude = {sh for sh, e in _read_ledger(directory).items() if e.get("prefer_default")}
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
    db = DeviceDB(directory, target)
    db_obj, contents = load_database(directory, exclude=set())  # coverage: every record counts
    if not contents.records:
        if explicit:
            raise BlockforgeError(f"{directory}: tuning database holds no records (run `blockforge tune` "
                                  "first, or drop --tuning-db)")
        return None, None
    db_obj, _ = load_database(directory)  # what is applied: in-model losers left out
    kept = sorted(e.get("task", sh) for sh, e in db.ledger().items() if e.get("prefer_default"))
    return db_obj, {"path": str(directory), "sha256": db.digest(), "records": len(contents.records),
                    "kept_default": kept}
