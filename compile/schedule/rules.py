"""The default CPU rule list, in the order ApplyDefaultSchedule tries them."""

from __future__ import annotations

from blockforge.compile.schedule.matmul import CPUMatmul
from blockforge.compile.schedule.matvec import CPUMatvec
from blockforge.compile.schedule.ragged import CPUMatmulRaggedN
from blockforge.compile.schedule.reduction import CPURowReduction


def default_cpu_rules() -> list:
    return [CPUMatvec(), CPUMatmul(), CPUMatmulRaggedN(), CPURowReduction()]
