"""The order the suite hands its tests to pytest-xdist (conftest.py `pytest_collection_modifyitems`).

The README runs two workers with `--dist worksteal` (pyproject.toml): each worker starts with one contiguous half
of the collection and, when its half runs out, takes the second half of the other's queue. A few tests start
doplus processes (multi-process runs, bench runs, killed and resumed runs) and take most of the suite's time. In
collection order they cluster in a few modules, so one half would hold most of them and its worker would finish
minutes after the other. Here each half starts with half of those tests and goes on with the light ones: the two
workers start on heavy work together, and what is left at the end, for either worker to take, is light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

HEAVY_MARKERS = ("processes", "cpu_processes", "slow")


def balanced_order(items: Sequence[T], heavy: Callable[[T], bool]) -> list[T]:
    """`items` reordered into two halves of (nearly) equal length, each beginning with alternate heavy items
    (in collection order) followed by light ones; every item kept once. Deterministic, since every worker must
    collect the same list."""
    heavy_items = [item for item in items if heavy(item)]
    light = [item for item in items if not heavy(item)]
    first_heavy, second_heavy = heavy_items[0::2], heavy_items[1::2]
    half = len(items) // 2
    split = max(0, min(len(light), half - len(first_heavy)))  # light items that fill the first half
    return [*first_heavy, *light[:split], *second_heavy, *light[split:]]


# The quick tier (`pytest -m quick`, docs/development.md): the modules that check the update rules, the losses,
# the metrics, the configuration and the command line against their references, without a doplus process, a
# real model or a bench. Their tests marked with a HEAVY_MARKERS marker stay out of it.
QUICK_MODULES = (
    "test_optim_rules", "test_optim_api", "test_optim_groups", "test_v_floor",  # the optimizer
    "test_losses", "test_losses_beyond_the_paper",  # the losses
    "test_eval_metrics", "test_similarity", "test_select_by", "test_paired", "test_sensitivity",  # the metrics
    "test_config_final", "test_config_fields_set_by_doplus", "test_list_options",  # config
    "test_refused_keys", "test_options_once",
    "test_registry", "test_layers", "test_public_imports", "test_cli", "test_toy_command", "test_suite_facts",
)


def quick(module: str, markers: Sequence[str]) -> bool:
    """Whether a test of `module` (its file's stem) carrying `markers` is in the quick tier."""
    return module in QUICK_MODULES and not set(markers) & set(HEAVY_MARKERS)
