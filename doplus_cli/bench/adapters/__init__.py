"""What `doplus bench schemes` needs of each training command it compares, one adapter per command
(bench/adapters/base.py): `unlearn`, `multitask`, `align`.

A command the bench compares is one adapter module here and one `register` line below, in the commands' order.
"""

from doplus_cli.bench.adapters.align import ALIGN_ADAPTER
from doplus_cli.bench.adapters.base import (
    ADAPTERS,
    BenchAdapter,
    Metric,
    TradeoffAxes,
    adapter_named,
    adapter_of,
    register,
)
from doplus_cli.bench.adapters.multitask import MULTITASK_ADAPTER
from doplus_cli.bench.adapters.unlearn import UNLEARN_ADAPTER

register(UNLEARN_ADAPTER)
register(MULTITASK_ADAPTER)
register(ALIGN_ADAPTER)

__all__ = ["ADAPTERS", "BenchAdapter", "Metric", "TradeoffAxes", "adapter_named", "adapter_of", "register"]
