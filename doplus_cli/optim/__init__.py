"""The DualOptim+ optimizer family.

Public contract (other tools depend on these names):

* `DualOptimPlus(params, lr, betas, base_betas, eps, weight_decay, objectives, inner, state_bits)`
  with `step(objective=...)`: one shared base state, one delta state per objective.
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
from doplus_cli.optim.dualoptim_plus import DualOptimPlus, muon_param_groups
from doplus_cli.optim.fl_schemes import FedCM, LocalAdam, Scaffold

__all__ = ["AdamW", "DualOptim", "DualOptimPlus", "FedCM", "LocalAdam", "Scaffold", "muon_param_groups"]
