"""`--select-by`: the step kept as best/ is the best of a known evaluation curve by the metric's direction, a
resumed run keeps the best it had before, and a metric the evaluation does not report is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_cli, write_sets
from tests.tiny_model import TOFU

# The metric at each step: the highest at step 2, the lowest at step 6; every step after 2 is below it
CURVE = {1: 10.0, 2: 50.0, 3: 20.0, 4: 30.0, 5: 40.0, 6: 5.0}


@pytest.fixture
def known_curve(monkeypatch):
    """The evaluation during training replaced by CURVE; the weights each evaluation saw, by step."""
    import doplus_cli.commands.unlearn as unlearn

    seen: dict[int, dict[str, torch.Tensor]] = {}

    def evaluate(step, accelerator, model, *rest):
        state = accelerator.unwrap_model(model).state_dict()
        seen[step] = {name: tensor.detach().clone() for name, tensor in state.items()}
        return {"step": step, "MU": CURVE[step], "UFE": CURVE[step]}

    monkeypatch.setattr(unlearn, "_evaluate_tofu", evaluate)
    return seen


def unlearn_args(model, data, out, *extra):
    return ["unlearn", "--eval-data-dir", TOFU, "--model", model, "--forget", data / "forget.jsonl",
            "--retain", data / "retain.jsonl",
            "--steps", 6, "--batch-size", 2, "--max-length", 32, "--show-samples", 0, "--eval-every", 1,
            "--lr", 1e-3, "--out", out, *extra]


def assert_best_is(out, seen, step):
    report = json.loads((out / "report.json").read_text())
    assert report["best"]["step"] == step and report["best"]["value"] == CURVE[step]
    assert f"by MU (max): step {step} " in (out / "final" / "README.md").read_text()
    assert f"by MU (max): step {step} " in (out / "report.md").read_text()
    kept = load_file(str(out / "best" / "model.safetensors"))
    assert kept and all(torch.equal(kept[name], seen[step][name]) for name in kept)
    assert not torch.equal(kept["lm_head.weight"], seen[6]["lm_head.weight"])  # not final/'s weights


def test_best_by_the_metric_direction_and_kept_over_a_resume(tiny_llama, tofu_dir, tmp_path, known_curve):
    data = write_sets(tofu_dir, tmp_path, 4, 8)
    out = tmp_path / "run"
    assert run_cli(*unlearn_args(tiny_llama, data, out, "--select-by", "MU", "--save-every", 2)) == 0
    assert_best_is(out, known_curve, 2)
    first = {step: weights for step, weights in known_curve.items()}

    # resumed from step 2: steps 3-6 all score below step 2's 50, so best/ stays step 2's
    (out / "report.json").unlink()
    assert run_cli(*unlearn_args(tiny_llama, data, out, "--select-by", "MU", "--save-every", 2, "--resume",
                                 out / "checkpoints" / "step-2")) == 0
    known_curve.update({2: first[2]})
    assert_best_is(out, known_curve, 2)

    # the other direction: the lowest UFE is the last step's
    other = tmp_path / "min"
    assert run_cli(*unlearn_args(tiny_llama, data, other, "--select-by", "UFE:min")) == 0
    report = json.loads((other / "report.json").read_text())
    assert report["best"] == {"metric": "UFE", "direction": "min", "step": 6, "value": 5.0,
                              "folder": str(other / "best")}


@pytest.mark.parametrize(("extra", "says"), [
    (["--select-by", "accuracy", "--eval-every", 1], "unknown metric 'accuracy'"),
    (["--select-by", "MU:up", "--eval-every", 1], "max or min"),
    (["--select-by", "MU"], "add --eval-every N"),
])
def test_a_metric_not_evaluated_is_one_line_and_exit_2(tiny_llama, tofu_dir, tmp_path, capsys, extra, says):
    data = write_sets(tofu_dir, tmp_path, 4, 8)
    args = ["unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--out", tmp_path / "run", *extra]
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_multitask_selects_by_a_task_name_or_the_average(tiny_llama, tofu_dir, tmp_path, capsys):
    """multitask's metrics are its task names and average: another name is one line, exit 2."""
    from doplus_cli.commands.multitask import MultitaskConfig
    from doplus_cli.config import resolve_config, task_from_option

    task = f"facts={tofu_dir / 'forget01.json'}"
    args = ["multitask", "--model", tiny_llama, "--task", task, "--prompt-key", "question", "--eval-every", 1,
            "--select-by", "MU", "--out", tmp_path / "run"]
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown metric 'MU': choose one of facts, average" in err and len(err.splitlines()) == 1
    config = resolve_config(None, {"tasks": [task_from_option(task)], "eval_every": 1, "select_by": "facts:min"},
                            MultitaskConfig)
    assert config.selectable_metrics() == {"facts": True, "average": True}


def test_bench_scores_each_run_at_its_best_step(tiny_llama, tofu_dir, tmp_path):
    """`bench schemes --summarize-from best`: refused for runs that keep no best step; an unlearn run is scored by
    its evaluation at the best step, a multitask run by that step's task scores."""
    from doplus_cli.bench.adapters import adapter_named
    from doplus_cli.bench.schemes import plan_bench
    from doplus_cli.bench.schemes.summary import check_summarize_from
    from doplus_cli.errors import UserError

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {tiny_llama}\nforget: {tofu_dir / 'forget01.json'}\n"
                      f"retain: {tofu_dir / 'retain90.json'}\neval_suite: tofu\neval_data_dir: {tofu_dir}\n")
    bench = plan_bench(str(recipe), "joint,doplus", "0", str(tmp_path / "bench"), [], None, False)
    with pytest.raises(UserError, match="keep no best step"):
        check_summarize_from(bench, "best")
    with pytest.raises(UserError, match="choose final or best"):
        check_summarize_from(bench, "last")
    bench = plan_bench(str(recipe), "joint,doplus", "0", str(tmp_path / "bench"),
                       ["select_by=MU", "eval_every=2"], None, False)
    assert check_summarize_from(bench, "best") == "best"

    folder = tmp_path / "run"
    (folder / "evals" / "step-4").mkdir(parents=True)
    (folder / "evals" / "step-4" / "eval.json").write_text("{}")
    report = {"best": {"metric": "MU", "step": 4}, "evals": [{"step": 4}, {"step": 6}], "steps": 6}
    assert adapter_named("unlearn").at_best(folder, report) == (report, folder / "evals" / "step-4")
    assert adapter_named("unlearn").at_best(folder, {**report, "best": {"step": 2}}) is None  # not evaluated there

    report = {"best": {"step": 2}, "evals": [{"step": 2, "a": 50.0, "average": 50.0},
                                             {"step": 4, "a": 10.0, "average": 10.0}],
              "scores": {"before": {"a": 0.0, "average": 0.0}, "after": {"a": 10.0, "average": 10.0}}}
    view, where = adapter_named("multitask").at_best(folder, report)
    assert view["scores"]["after"] == {"a": 50.0, "average": 50.0} and where == folder
    assert adapter_named("multitask").scores(view, where)[0] == {"a": 50.0, "average": 50.0}
    assert adapter_named("align").at_best(folder, report) is None


def test_under_lora_best_holds_the_adapter(tiny_llama, tofu_dir, tmp_path, known_curve):
    data = write_sets(tofu_dir, tmp_path, 4, 8)
    out = tmp_path / "run"
    assert run_cli(*unlearn_args(tiny_llama, data, out, "--select-by", "MU", "--lora-rank", 4)) == 0
    kept = load_file(str(out / "best" / "adapter_model.safetensors"))
    lora = {name: tensor for name, tensor in known_curve[2].items() if "lora_" in name}
    assert kept and len(kept) == len(lora)
    assert all(torch.equal(kept[name], lora[name.replace(".weight", ".default.weight")]) for name in kept)
