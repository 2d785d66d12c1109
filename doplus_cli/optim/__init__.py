"""The DualOptim+ optimizer family.

Public contract (other tools depend on these names):

* `DualOptimPlus(params, lr, betas, base_betas, eps, weight_decay, objectives, inner, state_bits)`
  with `step(objective=...)`: one shared base state, one delta state per objective.
* `dualoptim_plus(params, grads, states, deltas, compensations, *, lr, betas, ..., foreach=None, fused=None)`:
  DualOptim+'s AdamW rule as a function over one param group's tensors; `dualoptim_plus_updates(updates, ...)`
  the same over tensors of several groups (`TensorUpdate`s, each with its group's scalars), which
  `DualOptimPlus.step` calls. Each chooses the reference, compiled or multi-tensor implementation once per call
  and names it in its report. Every setting of `DualOptimPlus` but its objectives and their lr multipliers is a
  param group's, carried by `state_dict`.
  (It takes the name `doplus_cli.optim.dualoptim_plus`; the module is imported as
  `from doplus_cli.optim.dualoptim_plus import ...`.)
* `DualOptim(params, lr, betas, eps, weight_decay, objectives, state_bits)`: one AdamW per objective.
* The shared-state baselines (Joint, Alternate) use plain `torch.optim.AdamW`, or under `--precision bf16`
  doplus's `AdamW(params, lr, betas, eps, weight_decay, compensated=True)` (`adamw.py`).
* `Scaffold`, `FedCM`, `LocalAdam(params, lr, betas, eps, weight_decay, objectives, *, frequencies, ...)` with
  `step(objective=...)`: the paper's federated-learning baselines, whose base update (or merge) happens once per
  forget–retain period (`fl_schemes.py`).
* `compensated=True` on DualOptimPlus, DualOptim and AdamW: bf16 weights keep a bf16 compensation buffer
  each, read and written inside the update kernels (`kernels.py`), so small updates are not rounded away.
"""

from doplus_cli.optim.adamw import AdamW
from doplus_cli.optim.dualoptim import DualOptim
from doplus_cli.optim.dualoptim_plus import (
    DualOptimPlus,
    TensorUpdate,
    UpdateReport,
    dualoptim_plus,
    dualoptim_plus_updates,
    muon_param_groups,
)
from doplus_cli.optim.fl_schemes import FedCM, LocalAdam, Scaffold

__all__ = ["AdamW", "DualOptim", "DualOptimPlus", "FedCM", "LocalAdam", "Scaffold", "TensorUpdate", "UpdateReport",
           "dualoptim_plus", "dualoptim_plus_updates", "muon_param_groups"]
