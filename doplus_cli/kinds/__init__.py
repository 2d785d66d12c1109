"""The training commands, one kind each: `doplus unlearn`, `doplus multitask`, `doplus align` (kinds/base.py).

A new command is one module with its `Kind` and one `register` line here. A recipe is of the first registered
kind whose marker key it sets: `tasks` (multitask) before `forget` (unlearn) before `safety` (align).
"""

from doplus_cli.kinds.align import ALIGN
from doplus_cli.kinds.base import (
    KINDS,
    Kind,
    Metric,
    TradeoffAxes,
    kind_marked,
    kind_named,
    kind_of,
    register,
)
from doplus_cli.kinds.multitask import MULTITASK
from doplus_cli.kinds.unlearn import UNLEARN

register(MULTITASK)
register(UNLEARN)
register(ALIGN)

__all__ = ["KINDS", "Kind", "Metric", "TradeoffAxes", "kind_marked", "kind_named", "kind_of",
           "register"]
