"""`checkpoint.Processes`: this process's index, the number of processes, the main one and the barrier come from
accelerate's `PartialState`; doplus adds the per-process file names and the FSDP flag, and a dry run passes the
number of processes it plans for. Two real processes are covered by tests/test_distributed.py (a two-process run
writes `rng.rank0.pt` and `rng.rank1.pt` and resumes bit-identically)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from accelerate import PartialState

from doplus_cli.engine.checkpoint import Processes, check_processes
from doplus_cli.errors import UserError


def test_one_process_reads_accelerates_state_and_writes_unsuffixed_files():
    state = PartialState()
    processes = Processes()
    assert (processes.rank, processes.world, processes.main) == (state.process_index, state.num_processes, True)
    assert (processes.rank, processes.world) == (0, 1)  # pytest runs as one process
    processes.barrier()  # returns at once: nothing else to wait for
    assert processes.name("rng", ".pt") == "rng.pt"
    assert Processes(sharded=True).weights_name("model", ".safetensors") == "model.safetensors"


@pytest.mark.parametrize("sharded,weights", [(False, "model.safetensors"), (True, "model.rank0.safetensors")])
def test_a_planned_world_names_the_main_processs_files(sharded, weights):
    processes = Processes(sharded=sharded, world=3)
    assert (processes.rank, processes.world, processes.main, processes.sharded) == (0, 3, True, sharded)
    processes.barrier()  # a dry run starts no other process: nothing waits
    assert processes.name("rng", ".pt") == "rng.rank0.pt"
    assert processes.weights_name("model", ".safetensors") == weights


@pytest.mark.parametrize("state,planned,needle", [
    ({"world_size": 2, "sharded": True}, Processes(sharded=True, world=2), None),
    ({"world_size": 1}, Processes(world=2), "written by 1 process(es), this run has 2; resume with --num-processes 1"),
    ({"world_size": 2, "sharded": True}, Processes(world=2), "written with FSDP, this run is without"),
])
def test_a_dry_run_checks_the_layout_it_plans_for(state, planned, needle):
    path = Path("out/checkpoints/step-2")
    if needle is None:
        check_processes(path, state, planned)
    else:
        with pytest.raises(UserError, match=re.escape(needle)):
            check_processes(path, state, planned)
