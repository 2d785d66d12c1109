"""Rules the suite keeps so that a hang cannot eat CI's time: every subprocess a test starts is waited for with a
timeout (pytest-timeout, set in pyproject.toml, guards each test as a whole; a child process it leaves behind
would outlive it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BLOCKING = {"run", "check_output", "check_call", "call"}  # subprocess functions that wait for the child
WAITING = {"wait", "communicate"}  # Popen methods that wait for it


def calls_without_timeout(source: str, name: str) -> list[str]:
    """'file:line call' for each blocking subprocess call in `source` that passes no timeout."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner, method = node.func.value, node.func.attr
        blocking = method in BLOCKING and isinstance(owner, ast.Name) and owner.id == "subprocess"
        waiting = method in WAITING and not (isinstance(owner, ast.Name) and owner.id in {"os", "threading"})
        has_timeout = any(k.arg == "timeout" for k in node.keywords) or (method == "wait" and node.args)
        if (blocking or waiting) and not has_timeout:
            found.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_the_rule_finds_a_wait_without_a_timeout():
    source = ("import subprocess\nsubprocess.run(['x'], timeout=5)\nsubprocess.run(['x'])\n"
              "p = subprocess.Popen(['x'])\np.wait()\np.wait(timeout=3)\np.communicate(timeout=3)\n"
              "p.communicate()\nevent.wait(2)\n")
    assert calls_without_timeout(source, "t.py") == ["t.py:3 subprocess.run", "t.py:5 p.wait",
                                                     "t.py:8 p.communicate"]


def test_every_subprocess_a_test_starts_has_a_timeout():
    found = [hit for path in sorted(TESTS.glob("*.py"))
             for hit in calls_without_timeout(path.read_text(), path.name)]
    assert found == []


def test_each_half_of_the_order_starts_with_half_of_the_heavy_tests():
    """Nine items, four heavy (upper case): the first half (4 items, the first worker's under worksteal) starts
    with heavy A and C, the second with B and D; every item once, the light ones in collection order."""
    from tests.scheduling import balanced_order

    items = ["a", "A", "b", "B", "c", "C", "d", "D", "e"]
    order = balanced_order(items, str.isupper)
    assert order == ["A", "C", "a", "b", "B", "D", "c", "d", "e"]
    assert sorted(order) == sorted(items)
    assert balanced_order(["a", "b"], str.isupper) == ["a", "b"]
    assert balanced_order(["A", "B", "C"], str.isupper) == ["A", "C", "B"]


QUICK_COMMAND = "python -m pytest -q -n 2 -m quick tests"


def test_the_quick_tier_names_modules_that_exist_and_keeps_heavy_tests_out(request):
    """A module renamed or removed would leave the tier silently; a test that starts processes or loads the real
    model would make it slow. The tier's command is the one docs/development.md gives."""
    from tests.scheduling import HEAVY_MARKERS, QUICK_MODULES, quick

    assert sorted(name for name in QUICK_MODULES if not (TESTS / f"{name}.py").exists()) == []
    assert quick("test_losses", []) and quick("test_losses", ["parametrize"])
    assert not any(quick("test_losses", [marker]) for marker in HEAVY_MARKERS)
    assert not quick("test_bench_schemes", [])
    assert request.node.get_closest_marker("quick") is None  # this module is not in the tier
    assert QUICK_COMMAND in (TESTS.parent / "docs" / "development.md").read_text()
