"""doplus uses other libraries through their public API only: no module of the package imports a private module of
another library (`torch.optim._muon`, `typer._click`, `huggingface_hub.utils._http`) or a private name from one.
A private module changes or disappears in any release, so an import of one breaks doplus inside the version range
it declares (pyproject.toml), where the lowest-versions job (`.ci/lowest.sh`) cannot see it coming.

Every import counts, at the top of a module or inside a function; imports under `if TYPE_CHECKING:` too (they
still name the private module). Dunder names (`__future__`, `__version__`) are public."""

from __future__ import annotations

import ast
from pathlib import Path

import doplus_cli

PACKAGE = "doplus_cli"
ROOT = Path(doplus_cli.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str, package: str = PACKAGE) -> list[str]:
    """Each import in `source` of a module of another library with a `_`-prefixed part, or of a `_`-prefixed name
    from one, as `LINE: import a._b` or `LINE: from a import _b`; relative imports and `package`'s own are left
    out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] != package and any(map(_private, alias.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] != package:
            if any(map(_private, node.module.split("."))):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
            else:
                found += [f"{node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                          if _private(alias.name)]
    return found


def test_no_module_imports_a_private_module_or_name_of_another_library():
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path in sorted(ROOT.rglob("*.py"))
             for line in private_imports(path.read_text())]
    assert found == [], "private imports of other libraries (use their public API): " + "; ".join(found)


def test_the_check_finds_each_form_and_leaves_public_and_own_imports_alone():
    source = ("from __future__ import annotations\nimport torch._dynamo.config as c\nimport os, _thread\n"
              "from typer._click.core import ParameterSource\nfrom torch.optim import _muon\n"
              "from transformers import __version__\nfrom doplus_cli.optim import _private_helper\n"
              "from . import _sibling\nimport doplus_cli._recipes\n"
              "def f():\n    from huggingface_hub.utils._http import default_client_factory\n")
    assert private_imports(source) == [
        "2: import torch._dynamo.config", "3: import _thread", "4: from typer._click.core import ParameterSource",
        "5: from torch.optim import _muon", "11: from huggingface_hub.utils._http import default_client_factory"]
