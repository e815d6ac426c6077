"""Tuning: MetaSchedule jobs per device that resume and survive kill -9 (jobs), the
database's write side with rounds, merges and a lock (database), candidate measurement
(measure) and TVM's RPC tracker/servers for remote devices (rpc)."""

from .jobs import TuneOptions, TuneSummary, tune

__all__ = ["TuneOptions", "TuneSummary", "tune"]
