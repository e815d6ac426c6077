"""`blockforge targets`: the preset table and whether each builds / runs here."""

from __future__ import annotations

import json

from .common import print_table


def add(sub) -> None:
    p = sub.add_parser("targets", help="list target presets and whether they build / run here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.targets import list_targets

    rows = list_targets()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print_table(["preset", "build here", "run here", "precisions", "target", "why not"],
                [[r["name"], "yes" if r["can_build"] else "no", "yes" if r["can_run"] else "no",
                  ",".join(r["precisions"]), json.dumps(r["target"]), r["build_problem"] or r["run_problem"] or ""]
                 for r in rows])
    return 0
