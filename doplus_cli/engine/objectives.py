"""A run is a list of objectives; a command (unlearn, multitask, align) builds that list and the loop trains on it.

Each objective has a name (handed to `optimizer.step(objective=name)` and used in the logged loss terms
`{name}_loss`), a data source, a loss, a weight (its factor in a joint step's sum), a frequency (F_i
consecutive steps per cycle) and a learning-rate multiplier. The loop gives it an `IndexStream` over its
rows, seeded with `seed + its position in the list`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from doplus_cli.data.batches import IndexStream, build_batch
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.data.sources import Source
from doplus_cli.losses import LossParams, LossSpec


@dataclass
class Objective:
    name: str
    source: Source
    loss: LossSpec
    weight: float = 1.0
    frequency: int = 1
    lr_multiplier: float = 1.0
    stream: IndexStream | None = None

    def next_batch(self, formatter: PromptFormatter, device: torch.device, seed: int) -> dict:
        batch = build_batch(
            self.source, self.stream.next_indices(), formatter, with_rejection=self.loss.needs_rejection, seed=seed
        )
        return {part: {k: v.to(device) for k, v in tensors.items()} for part, tensors in batch.items()}


def frequencies(objectives: Sequence[Objective]) -> list[tuple[str, int]]:
    return [(o.name, o.frequency) for o in objectives]


def lr_multipliers(objectives: Sequence[Objective]) -> dict[str, float]:
    """{name: multiplier} for the objectives whose steps use another learning rate than --lr."""
    return {o.name: o.lr_multiplier for o in objectives if o.lr_multiplier != 1.0}


class Plan:
    """The hooks a command gives the one training loop (`engine.loop.run_training`): its data and objectives,
    what it measures before, during and after training, and its report. Each command implements them in its own
    module (`commands.base.Command` and its subclasses). The loop calls, in this order:

    open() (data checked before anything is written) -> total_steps() -> default_warmup() -> objectives(model, ...) ->
    before(model, ...) -> prepare_model(model) ->
    [training; evaluate(step, ...) every --eval-every steps] -> after(model, ...) ->
    data_report(), curve_names(config), render_report(report).
    """

    command = "train"  # the default output folder is runs/{command}-DATE-TIME
    config_class: type | None = None  # a command's config class; None: an engine caller's own plan, no command line
    card_title = "trained"  # the model card's title: "OUT: {card_title} with doplus {command}"
    activity = "training"  # the progress bar's label
    lr_options = "--lr"  # named when a non-finite loss stops the run
    beta = 0.1  # the temperature handed to the losses (NPO, DPO, AP)
    loss_params = LossParams()  # the other losses' hyper-parameters (SimNPO, UNDIAL, WGA, SatImp, RMU)

    def open(self) -> None:
        """Open (and check) the data sources."""

    def total_steps(self, effective_batch: int) -> int | None:
        """The number of optimizer steps when the command derives it from its data (align's --epochs); None:
        --steps."""
        return None

    def default_warmup(self, effective_batch: int) -> int:
        return 0

    def objectives(self, model, formatter, out, progress, accelerator, resumed: bool) -> list[Objective]:
        raise NotImplementedError

    def prepare_model(self, model) -> None:
        """Called once the model is final (after LoRA) and before the optimizer is built: e.g. RMU leaves only
        its chosen modules trainable."""

    def before(self, model, formatter, progress, accelerator, saved: Any | None) -> Any:
        """Measurements of the starting model (JSON-able; kept in checkpoints, so `saved` on resume)."""
        return saved

    def evaluate(self, step: int, model, tokenizer, formatter, out, progress, accelerator) -> dict[str, Any]:
        return {"step": step}

    def after(self, model, formatter, progress, accelerator, before: Any) -> dict[str, Any]:
        """Report entries measured on the final model (every process calls it)."""
        return {}

    def data_report(self) -> dict[str, Any]:
        return {}

    def planned_out(self, config, out: Path) -> str | None:
        """A dry run's line for OUT when the command lays out its folder itself (unlearn's --continual: a run per
        task), after the checks that layout makes; None: the loop's own run folder."""
        return None

    def outputs(self, config) -> tuple[str, ...]:
        """The entries a run of `config` writes directly in OUT beyond the loop's own (`engine.loop.run_outputs`):
        recorded before the run writes anything, so that only they are ever replaced (ownership.py)."""
        return ()

    def curve_names(self, config) -> tuple[str, ...]:
        """The evaluation values of a run of `config` plotted against the step (evals/curves.png, and the bench's
        curves)."""
        return ()

    def render_report(self, report: dict[str, Any]) -> str:
        """report.md."""
        raise NotImplementedError

    def card_method(self, config: dict[str, Any]) -> str:
        """The model card's words for the method of a run recorded with `config` (config.yaml's values), after
        the scheme on its Training line."""
        return ""

    def state_objectives(self) -> int:
        """How many objectives keep an optimizer state of their own (the memory plan counts DualOptim's and
        DualOptim+'s states by it)."""
        return 2

    def needs_reference(self) -> bool:
        """Whether the run keeps a frozen copy of the starting model (the memory plan counts it)."""
        return False
