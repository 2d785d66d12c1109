"""The training commands, one module each: `doplus unlearn`, `doplus multitask`, `doplus align` (commands/base.py).

A new command is one module with its `Command` and one `register` line here; `doplus --help` lists the commands in
the order of these lines. A recipe is of the command whose marker key it sets (`forget`, `tasks`, `safety`: each
config class has its own marker alone; with several set, as by --set, the first registered wins).
"""

from doplus_cli.commands.align import ALIGN
from doplus_cli.commands.base import COMMANDS, Command, command_for, command_marked, command_named, register
from doplus_cli.commands.multitask import MULTITASK
from doplus_cli.commands.unlearn import UNLEARN

register(UNLEARN)
register(MULTITASK)
register(ALIGN)

__all__ = ["COMMANDS", "Command", "command_for", "command_marked", "command_named", "register"]
