"""The training commands, one module each: `doplus unlearn`, `doplus multitask`, `doplus align` (commands/base.py).

A new command is one module with its `Command` and one `register` line here. A recipe is of the first registered
command whose marker key it sets: `tasks` (multitask) before `forget` (unlearn) before `safety` (align).
"""

from doplus_cli.commands.align import ALIGN
from doplus_cli.commands.base import COMMANDS, Command, command_marked, command_named, register
from doplus_cli.commands.multitask import MULTITASK
from doplus_cli.commands.unlearn import UNLEARN

register(MULTITASK)
register(UNLEARN)
register(ALIGN)

__all__ = ["COMMANDS", "Command", "command_marked", "command_named", "register"]
