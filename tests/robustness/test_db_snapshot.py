"""A compile that reads a tuning database while a tune merges into it sees the old database
or the new one, never a mix (new records naming workloads it did not read, a digest of
other bytes than it applied): merges rename under an exclusive flock of the directory,
reads hold it shared (tune/database.py, compile/records/reader.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time

from blockforge.compile.records.reader import RECORDS, WORKLOADS, read_contents
from blockforge.errors import BlockforgeError

WRITER_SECONDS = 3.0
# A tune's merges as fast as they go: each round adds a new workload and a record of it
# (the case a reader between the two renames used to see as a dangling index). The
# writer logs the digest of every state it committed.
WRITER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from blockforge.tune.database import DeviceDB
    from blockforge.compile.records.reader import RECORDS, WORKLOADS

    d, log, seconds = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    db = DeviceDB(d)
    record = [[[], []], [1e-5], {"kind": "llvm"}, []]
    end, n = time.monotonic() + seconds, 0
    with open(log, "w") as out:
        out.write(db.digest() + "\\n")
        while time.monotonic() < end:
            n += 1
            s = d / f"round{n}"
            s.mkdir()
            (s / WORKLOADS).write_text(json.dumps([f"w{n}", {}]) + "\\n")
            (s / RECORDS).write_text(json.dumps([0, record]) + "\\n")
            db.merge(s)
            out.write(db.digest() + "\\n")
            out.flush()
""")


def _seed(d):
    d.mkdir()
    (d / WORKLOADS).write_text(json.dumps(["w0", {}]) + "\n")
    (d / RECORDS).write_text(json.dumps([0, [[[], []], [1e-5], {"kind": "llvm"}, []]]) + "\n")


def test_reads_during_merges_are_snapshots(tmp_path):
    d, log = tmp_path / "db", tmp_path / "committed.txt"
    _seed(d)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(log), str(WRITER_SECONDS)],
                              stderr=subprocess.PIPE, text=True)
    seen, failures = [], []
    deadline = time.monotonic() + WRITER_SECONDS + 60
    while writer.poll() is None and time.monotonic() < deadline:
        for torn_ok in (True, False):  # compile's reads, and tune's
            try:
                c = read_contents(d, tolerate_torn_tail=torn_ok)
            except BlockforgeError as e:
                failures.append(str(e))
                continue
            # the state these contents are: the digest of exactly their lines
            seen.append((hashlib.sha256("".join(line + "\n" for _, line in c.workloads).encode()
                                        + "".join(line + "\n" for _, line in c.records).encode()).hexdigest(), c))
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    committed = set(log.read_text().split())
    assert failures == [], f"{len(failures)} of {len(seen) + len(failures)} reads failed: {failures[0]}"
    assert len(seen) > 100 and len(committed) > 20, (len(seen), len(committed))
    stray = [s for s, _ in seen if s not in committed]
    assert stray == [], f"{len(stray)} of {len(seen)} reads saw a state the writer never committed"
    assert len({s for s, _ in seen}) > 5  # the reads overlapped the merges
    # what compile's manifest records is the digest of the snapshot it applied
    assert all(c.sha256 == s for s, c in seen)
