"""The DualOptim+ optimizer family.

Public contract (other tools depend on these names):

* `DualOptimPlus(params, lr, betas, base_betas, eps, weight_decay, objectives, inner, state_bits)`
  with `step(objective=...)`: one shared base state, one delta state per objective.
* `DualOptim(params, lr, betas, eps, weight_decay, objectives, state_bits)`: one AdamW per objective.
* The shared-state baselines (Joint, Alternate) use plain `torch.optim.AdamW`.
"""

from doplus_cli.optim.dualoptim import DualOptim
from doplus_cli.optim.dualoptim_plus import DualOptimPlus, muon_param_groups

__all__ = ["DualOptim", "DualOptimPlus", "muon_param_groups"]
