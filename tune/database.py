"""Tuning databases as tune writes them: safe against kill -9, shared across models.

The format and the read side are compile's (blockforge.compile.records.reader); this module
owns writing: rounds, merges, the ledger, salvage and the lock.

    <db>/scratch/<job>-<round>/   rounds in flight (begin_round / commit_round); salvaged
                                  by the next job
    <db>/tune.log                 TVM's logs of the jobs

MetaSchedule's JSONDatabase appends lines without fsync and refuses to load a torn line.
blockforge never lets TVM write the device files: each round tunes into a scratch copy
(of the records record_policy accepts: TVM never sees a refused one), then the new
records are merged into fresh files that are staged and renamed into place together
under an exclusive flock of the directory. Readers (compile.records.read_contents) hold
it shared, so a compile reading during a merge sees the old database or the new one,
never new workloads with old records (or the reverse), and the digest it records is of
what it applied. A torn last line of a scratch file (the kill landed mid-write) is
dropped; every complete line is kept. Refused records of the device files stay in them
(they are the user's; they are reported, never applied).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from blockforge.compile.records.reader import (DEVICE, FAILED_RUN_SECS, FORMAT, LEDGER, RECORDS, WORKLOADS, Contents,
                                        check_device, digest, is_database, load_database, read_contents,
                                        read_ledger)
from blockforge.errors import BlockforgeError
from blockforge.fsutil import atomic_write_group, atomic_write_json, dir_lock, json_bytes
from blockforge.targets import ResolvedTarget

SCRATCH = "scratch"
SCRATCH_MARK = ".blockforge-scratch"
_COPIED = "copied_records"  # how many records a round started with (only the rest are new)


@dataclass(frozen=True)
class Round:
    path: Path  # a MetaSchedule work_dir for this round
    copied: int  # records copied in from the device database


def _has_foreign_content(path: Path) -> bool:
    ours = {DEVICE, LEDGER, WORKLOADS, RECORDS, SCRATCH, "summaries", "tune.log", ".lock", ".lock.owner"}
    try:
        return any(p.name not in ours for p in path.iterdir())
    except OSError:
        return False


class DeviceDB:
    """The device database directory, used under `lock()` for writing."""

    def __init__(self, path: Path, target: ResolvedTarget | None = None, *, create: bool = False,
                 cpu: str | None = None):
        """cpu: the CPU that tunes (toolchain.cpu_id()), recorded in a new database's
        device.json; None where the measurements happen elsewhere (RPC)."""
        self.path = Path(path)
        self.cpu = cpu
        self.refused: dict[str, None] = {}  # warnings for refused records seen (ordered set)
        self._replayable: set[str] = set()  # record lines MetaSchedule is known to load
        if self.path.exists() and not self.path.is_dir():
            raise BlockforgeError(f"{self.path}: tuning database must be a directory")
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise BlockforgeError(f"{self.path}: no such tuning database")
        self._check_device(target, create)

    # -- identity ---------------------------------------------------------------
    def _check_device(self, target: ResolvedTarget | None, create: bool) -> None:
        if check_device(self.path, target) is None and create and target is not None:
            if not is_database(self.path) and _has_foreign_content(self.path):
                raise BlockforgeError(f"{self.path} exists and is not a tuning database; refusing to write "
                                      "into it (choose an empty or new directory)")
            info = {"format": FORMAT, "key": target.key(), "target": target.target_json}
            if self.cpu:
                info["cpu_model"] = self.cpu
            atomic_write_json(self.path / DEVICE, info)

    # -- reading ----------------------------------------------------------------
    def contents(self) -> Contents:
        c = read_contents(self.path, tolerate_torn_tail=False)
        self.refused.update(dict.fromkeys(c.warnings()))
        return c

    def _replace(self, files: dict[str, bytes]) -> None:
        """Replace files of the database together, renamed under the directory's exclusive
        lock (what read_contents' shared lock waits for)."""
        atomic_write_group({self.path / name: data for name, data in files.items()},
                           hold=dir_lock(self.path, exclusive=True))

    def ledger(self) -> dict[str, dict]:
        return read_ledger(self.path)

    def set_ledger_flag(self, shash: str, key: str, value) -> None:
        led = self.ledger()
        led.setdefault(shash, {"trials": 0})[key] = value
        try:
            self._replace({LEDGER: json_bytes(led)})
        except OSError as e:
            raise BlockforgeError(f"cannot write tuning ledger {self.path / LEDGER}: {e.strerror or e}") from None

    def set_verdict(self, shash: str, cpu: str, prefer_default: bool, default_ms: float, record_ms: float,
                    scope: str = "task") -> None:
        """Record this CPU's in-model A/B verdict for a workload (other CPUs' verdicts stay).
        scope "task": this workload's record alone vs the default; "model": all the model's
        winning records together vs the untuned build (the ms are the whole model's)."""
        by_cpu = dict(self.ledger().get(shash, {}).get("in_model") or {})
        by_cpu[cpu] = {"prefer_default": bool(prefer_default), "default_ms": round(default_ms, 4),
                       "record_ms": round(record_ms, 4), "scope": scope, "at": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.set_ledger_flag(shash, "in_model", by_cpu)

    def spent(self, shash: str, contents: Contents | None = None) -> int:
        """Trials spent on a workload: the ledger, or its records (minus the default-schedule
        seed, which is not a search trial) where a lost ledger update undercounts."""
        c = contents or self.contents()
        entry = self.ledger().get(shash, {})
        recs = len(c.by_workload().get(shash, [])) - (1 if entry.get("seeded") else 0)
        return max(recs, int(entry.get("trials", 0)))

    def digest(self) -> str:
        return digest(self.path)

    # -- writing ----------------------------------------------------------------
    def merge(self, scratch: Path, skip_records: int = 0) -> dict[str, int]:
        """Merge complete records of a scratch database (after its first `skip_records`,
        which were copied from here) into the device files. Returns records added per workload."""
        new = read_contents(scratch, tolerate_torn_tail=True)
        self.refused.update(dict.fromkeys(new.warnings()))  # TVM's own output: an allow-list gap
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
        kept = [line for _, line in cur.records] + [r.text for r in cur.refused]
        self._replayable.update(new_records)  # TVM wrote them from schedules it built
        try:
            self._replace({WORKLOADS: "".join(line + "\n" for _, line in workloads).encode(),
                           RECORDS: "".join(line + "\n" for line in kept + new_records).encode()})
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
            self._replace({LEDGER: json_bytes(led)})
        except OSError as e:
            raise BlockforgeError(f"cannot write tuning ledger {self.path / LEDGER}: {e.strerror or e}") from None

    def mark_seeded(self, shash: str, name: str) -> None:
        self.set_ledger_flag(shash, "seeded", True)
        self.set_ledger_flag(shash, "task", name)

    # -- rounds -----------------------------------------------------------------
    def begin_round(self, job: str, n: int) -> Round:
        """A scratch database for one tuning round, seeded with the device's records so the
        search knows them. Only what the round adds is merged back (commit_round)."""
        root = self.path / SCRATCH
        root.mkdir(exist_ok=True)
        (root / SCRATCH_MARK).touch()
        d = root / f"{job}-{n}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        c = self._replayable_contents()  # TVM's search replays these
        (d / WORKLOADS).write_text("".join(line + "\n" for _, line in c.workloads))
        (d / RECORDS).write_text("".join(line + "\n" for _, line in c.records))
        copied = len(c.records)
        (d / _COPIED).write_text(str(copied))
        return Round(d, copied)

    def _replayable_contents(self) -> Contents:
        """The records a round may start from: those the policy accepts, less any that
        MetaSchedule cannot replay (its JSONDatabase, which the round's search opens, fails
        as a whole on one). Checked with one load the first time a job sees a record; the
        records a job merges are TVM's own and known good."""
        c = self.contents()
        if all(line in self._replayable for _, line in c.records):
            return c
        _, loaded = load_database(self.path, exclude=set(), contents=c)
        bad = {r.line for r in loaded.refused} - {r.line for r in c.refused}
        self.refused.update(dict.fromkeys(w for r, w in zip(loaded.refused, loaded.warnings()) if r.line in bad))
        keep = [k for k, n in enumerate(c.linenos) if n not in bad]
        c = Contents(c.workloads, [c.records[k] for k in keep], c.refused, c.sha256, c.ledger, c.path,
                     [c.linenos[k] for k in keep])
        self._replayable.update(line for _, line in c.records)
        return c

    def commit_round(self, rnd: Round) -> dict[str, int]:
        """Merge a finished round's new records, then drop its scratch directory."""
        added = self.merge(rnd.path, rnd.copied)
        shutil.rmtree(rnd.path, ignore_errors=True)
        return added

    def salvage(self) -> dict[str, int]:
        """Merge what killed jobs left in scratch/, then remove those rounds. Call under the lock.

        Only round directories blockforge made are touched (scratch/ carries our marker and
        each round its copied-records count): a user's own `scratch/` folder is left alone."""
        total: dict[str, int] = {}
        root = self.path / SCRATCH
        if not (root.is_dir() and (root / SCRATCH_MARK).is_file()):
            return total
        for d in sorted(root.iterdir()):
            if not (d.is_dir() and not d.is_symlink() and (d / _COPIED).is_file()):
                continue
            try:
                skip = int((d / _COPIED).read_text().strip() or 0)
            except (OSError, ValueError):
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
        atomic_write_group({dest / WORKLOADS: "".join(c.workloads[i][1] + "\n" for i in keep).encode(),
                            dest / RECORDS: "".join(r + "\n" for r in records).encode()},
                           hold=dir_lock(dest, exclusive=True))
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
                                  "wait for it to finish or use another tuning database") from None
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


