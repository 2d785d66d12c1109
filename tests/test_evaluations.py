"""The evaluation a training command runs in its own process and the `doplus evaluate` command its bench adapter
runs for `bench schemes` are one evaluation: the command line, parsed by `doplus evaluate` itself, gives the
EvalConfig the command evaluates with (engine/evaluations.py maps both)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

import doplus_cli.cli as cli
import doplus_cli.commands.unlearn as engine_unlearn
import doplus_cli.evaluation.runner as runner
import doplus_cli.evaluation.summary as summary
from doplus_cli.bench.adapters import adapter_named
from doplus_cli.commands.align import AlignConfig, align_evaluation, evaluate_final
from doplus_cli.commands.unlearn import UnlearnConfig, unlearn_evaluation
from doplus_cli.evaluation.suite_api import EvalConfig
from tests.helpers import run_cli

# Every eval_* option of each command, none at its default. No `doplus evaluate` flag carries eval_every (when
# training evaluates) or unlearn's eval_attacks (the attacks of its last evaluation during training, which the
# engine adds to that one evaluation); align's eval_attacks is the --attacks of its evaluation of final/.
UNLEARN_TOFU = dict(
    model="start-model", eval_suite="tofu", eval_split="forget05", eval_data_dir="/data/tofu", eval_max_samples=3,
    eval_max_new_tokens=7, eval_nli_model="/judges/nli", eval_embedding_model="/judges/embedder",
    eval_protocol="paper", eval_batch_size=5, eval_every=2, eval_attacks="quant-4bit", seed=11, dtype="bfloat16",
    task_id=2, prompt_template="phi-tofu", trust_remote_code=True,
)
ALIGN = dict(
    eval_suite="safety, xstest", eval_max_samples=3, eval_max_new_tokens=7, eval_guard_model="none",
    eval_refusal_model="/judges/refusal", eval_safety_data_dir="/data/safety", eval_batch_size=5, eval_every=2,
    eval_attacks="quant-4bit,probe-prefix", seed=11, dtype="float32", trust_remote_code=True,
)


def test_every_eval_option_is_set_off_its_default():
    """The configs below cover a new eval_* option only once it is set here."""
    for config_class, values in ((UnlearnConfig, UNLEARN_TOFU), (AlignConfig, ALIGN)):
        defaults = config_class()
        names = {f.name for f in dataclasses.fields(config_class) if f.name.startswith("eval_")}
        assert names <= set(values), sorted(names - set(values))
        at_default = [name for name in names if values[name] == getattr(defaults, name)]
        # unlearn's suite is its default, tofu; the other suites are set where the flags are compared
        assert at_default == (["eval_suite"] if config_class is UnlearnConfig else [])


def parsed(command: list[str], monkeypatch) -> EvalConfig:
    """The EvalConfig `doplus evaluate` resolves the command to (its own option parsing, in this process)."""
    seen: list[EvalConfig] = []
    monkeypatch.setattr(cli, "run_evaluate", lambda config, *rest: seen.append(config) or {"sections": []})
    monkeypatch.setattr(summary, "print_summary", lambda *args: None)
    assert command[1:4] == ["-m", "doplus_cli", "evaluate"]
    assert run_cli(*command[3:]) == 0
    return seen[0]


@pytest.mark.parametrize("case", ["tofu", "muse", "wmdp", "align"])
def test_the_command_line_parses_to_the_builders_config(case, tmp_path, monkeypatch):
    if case == "align":
        config = AlignConfig(**ALIGN)
        evaluation, kind = align_evaluation(config), adapter_named("align")
        command = kind.evaluate_command(config, tmp_path)
        expected = evaluation.config(str(tmp_path / "final"), str(tmp_path / "eval"))
        assert expected.suites == ("safety", "xstest")
    else:
        values = dict(UNLEARN_TOFU)
        if case != "tofu":  # the corpus, or the questions per task (lm-eval's --limit)
            values.update(eval_suite=case, eval_split="books" if case == "muse" else "forget10")
        config = UnlearnConfig(**values)
        evaluation, kind = unlearn_evaluation(config), adapter_named("unlearn")
        command = kind.evaluate_command(config, tmp_path, "start-model", tmp_path / "start")
        expected = evaluation.config("start-model", str(tmp_path / "start"))
    defaults = EvalConfig()
    set_fields = {f.name for f in dataclasses.fields(EvalConfig)
                  if getattr(expected, f.name) != getattr(defaults, f.name)}
    assert {"batch_size", "seed", "dtype", "trust_remote_code", "overwrite"} <= set_fields
    assert parsed(command, monkeypatch) == expected


def test_the_evaluation_during_training_is_the_one_bench_runs_on_the_starting_model(tmp_path, monkeypatch):
    """The starting model, the first point of the curves, is evaluated as the run evaluates its steps: the same
    prompt template (a taught or hub model has no run folder to read it from), dtype and remote code."""
    config = UnlearnConfig(**UNLEARN_TOFU)
    seen: list[EvalConfig] = []

    def evaluate_model(model, tokenizer, eval_config, *rest, **options):
        seen.append(eval_config)
        return {"sections": []}

    monkeypatch.setattr(engine_unlearn, "evaluate_model", evaluate_model)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, unwrap_model=lambda model: model,
                                  wait_for_everyone=lambda: None, device=SimpleNamespace(type="cpu"))
    model = SimpleNamespace(train=lambda: None)
    state = {"judges": object(), "task_id": config.task_id}
    engine_unlearn._evaluate_tofu(1, accelerator, model, None, config, tmp_path, None, state)
    during = seen[0]
    assert (during.prompt_template, during.dtype, during.trust_remote_code) == ("phi-tofu", "bfloat16", True)
    command = adapter_named("unlearn").evaluate_command(config, tmp_path, config.model, tmp_path / "start")
    started = parsed(command, monkeypatch)
    assert dataclasses.replace(started, out=None, overwrite=False) == during


def test_align_evaluates_final_as_its_kind_command_does(tmp_path, monkeypatch):
    config = AlignConfig(**ALIGN)
    seen: list[tuple[EvalConfig, object]] = []
    monkeypatch.setattr(runner, "run_evaluate", lambda eval_config, console, attacks=None: seen.append(
        (eval_config, attacks)) or {"sections": [], "wall_time_s": 0})
    report = {"config": {"out": str(tmp_path)}, "final": str(tmp_path / "final")}
    assert evaluate_final(config, report, None)["folder"] == str(Path(tmp_path) / "eval")
    eval_config, attack_runner = seen[0]
    assert eval_config.attacks == ("quant-4bit", "probe-prefix") and callable(attack_runner)
    assert parsed(adapter_named("align").evaluate_command(config, tmp_path), monkeypatch) == eval_config
