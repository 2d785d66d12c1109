"""--report-to (experiment trackers through accelerate) and the model card final/README.md.

TensorBoard's events are read back with TensorBoard's own reader, MLflow's store with MlflowClient; both must
hold what metrics.jsonl holds, at the same steps, once each (also across a kill and --resume, and on two
processes). The model card is read with huggingface_hub; its sha256 are recomputed here from the data files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import sys

import pytest
import yaml

from doplus_cli.engine.checkpoint import list_checkpoints
from tests.helpers import launch, run_cli, two_processes, wait_for_steps, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("tracking-data"), 8, 12)


def args(model, data, out, steps, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "NPO+GD", "--forget-freq", 1, "--retain-freq", 1, "--steps", steps, "--lr", 1e-3,
            "--batch-size", 2, "--max-length", 48, "--show-samples", 0, "--out", out, *extra]


def records(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under `folder` (each run's event folder) as (step, value), read by TensorBoard itself."""
    from tensorboard.backend.event_processing import event_accumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for events in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        accumulator = event_accumulator.EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


def mlflow_client(out):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{out / 'trackers' / 'mlflow.db'}")


def only_run(client):
    experiment = client.get_experiment_by_name("doplus-unlearn")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one training, one tracker run
    return runs[0]


@pytest.fixture(scope="module")
def tracked(tiny_llama, data, tofu_dir, tmp_path_factory):
    """4 steps with TensorBoard and MLflow, evaluated (TOFU suite, 2 questions) at steps 2 and 4."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    assert run_cli(*args(tiny_llama, data, out, 4, "--report-to", "tensorboard,mlflow", "--eval-every", 2,
                         "--eval-data-dir", tofu_dir, "--eval-max-samples", 2, "--eval-max-new-tokens", 4)) == 0
    return out


def test_tensorboard_events_hold_each_steps_losses_lr_and_the_evaluations(tracked):
    scalars = tensorboard_scalars(tracked / "trackers" / "tensorboard")
    rows = records(tracked)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("forget_loss", "retain_loss", "lr", "grad_norm", "max_update"):
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert expected, key
        got = sorted(scalars[f"train/{key}"])
        assert [s for s, _ in got] == [s for s, _ in expected], key
        for (_, value), (_, want) in zip(got, expected):
            assert value == pytest.approx(want, rel=1e-6, abs=1e-12), key  # TensorBoard keeps float32
    evals = json.loads((tracked / "report.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [2, 4]
    for name in ("UFE", "TFE", "OVR"):
        got = sorted(scalars[f"eval/{name}"])
        assert [s for s, _ in got] == [2, 4], name
        assert [v for _, v in got] == pytest.approx([e[name] for e in evals], rel=1e-6), name
    assert scalars["final/wall_time_s"][0][0] == 4  # the final report's numbers, at the last step


def test_mlflow_store_holds_the_same_history_and_the_configuration_as_params(tracked):
    client = mlflow_client(tracked)
    run = only_run(client)
    rows = records(tracked)
    for key in ("forget_loss", "retain_loss", "lr", "grad_norm"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{key}"))
        assert history == [(r["step"], r[key]) for r in rows if r.get(key) is not None], key  # float64 kept
    config = yaml.safe_load((tracked / "config.yaml").read_text())
    params = run.data.params
    assert params["lr"] == str(config["lr"]) and params["steps"] == "4" and params["loss"] == "NPO+GD"
    assert params["betas"] == "[0.9, 0.95]" and params["task_id"] == "None" and params["command"] == "unlearn"
    eval_history = sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/OVR"))
    assert eval_history == [2, 4]
    assert run.data.tags["scheme"] == "doplus" and run.data.tags["mlflow.runName"] == "run"


def test_the_model_card_parses_validates_and_names_the_data_and_the_command(tracked, monkeypatch):
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.load(tracked / "final" / "README.md")
    metadata = card.data.to_dict()
    ModelCardData(**metadata)  # the hub's own metadata class takes it back
    assert metadata["library_name"] == "transformers" and {"unlearning", "dualoptim-plus"} <= set(metadata["tags"])
    assert "base_model" not in metadata  # a local folder is no hub model
    text = card.text
    config = yaml.safe_load((tracked / "config.yaml").read_text())
    for role in ("forget", "retain"):
        path = config[role]
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        rows = sum(1 for line in open(path) if line.strip())
        assert re.search(rf"\| {role} \| [^|]+ \| {re.escape(path)} \| {rows} \| {rows} \| {digest} \|", text), role
    assert "| 2 |" in text and "| 4 |" in text and "OVR" in text  # the evaluation table
    assert "doplus 0.1.0" in text or re.search(r"doplus \d+\.\d+", text)
    command = re.search(r"```\n(doplus unlearn .*)\n```", text).group(1)
    parsed = parse_back(command, monkeypatch)
    saved = yaml.safe_load((tracked / "config.yaml").read_text())
    for key in ("resume", "overwrite"):
        saved.pop(key), parsed.pop(key)
    assert parsed == saved


def parse_back(command: str, monkeypatch) -> dict:
    """The config `doplus ...` resolves to, without running it."""
    captured = {}

    def capture(config, console=None):
        captured.update(config.to_dict())
        return {}

    monkeypatch.setattr("doplus_cli.commands.unlearn.run_unlearn", capture)
    monkeypatch.setattr("doplus_cli.commands.multitask.run_multitask", capture)
    words = shlex.split(command)
    assert words[0] == "doplus"
    assert run_cli(*words[1:]) == 0
    return captured


def test_a_lora_adapter_gets_a_peft_card(tiny_llama, data, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "lora"
    assert run_cli(*args(tiny_llama, data, out, 2, "--lora-rank", 2, "--save-adapter-only")) == 0
    card = ModelCard.load(out / "final" / "README.md")
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "LoRA adapter only" in card.text and (out / "final" / "adapter_config.json").is_file()
    assert not (out / "trackers").exists()  # --report-to none (the default) writes no tracker files


def test_hub_sources_become_base_model_and_datasets():
    from huggingface_hub.utils import validate_repo_id

    from doplus_cli.engine.model_card import EMBEDDED_HUB_ID, base_model, hub_dataset

    assert base_model({"config": {"model": None}}) == EMBEDDED_HUB_ID
    assert base_model({"config": {"model": "locuslab/tofu_ft_llama2-7b"}}) == "locuslab/tofu_ft_llama2-7b"
    validate_repo_id(EMBEDDED_HUB_ID)
    assert hub_dataset("hf:locuslab/TOFU:forget10@train") == "locuslab/TOFU"


@pytest.mark.processes
def test_a_killed_run_resumed_logs_each_step_exactly_once(tiny_llama, data, tmp_path):
    steps = 16  # the kill lands at step 5 or a little later, well before the end
    out = tmp_path / "killed"
    command = args(tiny_llama, data, out, steps, "--save-every", 3, "--report-to", "tensorboard,mlflow")
    process = launch(command)
    wait_for_steps(out, 5, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    kept = list_checkpoints(out / "checkpoints")
    assert kept and not (out / "final").exists()
    assert run_cli(*command, "--resume") == 0
    rows = records(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    scalars = tensorboard_scalars(out / "trackers" / "tensorboard")
    for key in ("forget_loss", "retain_loss", "lr"):
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        got = sorted(scalars[f"train/{key}"])
        assert [s for s, _ in got] == [s for s, _ in expected], (key, kept)  # each step once
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)
    client = mlflow_client(out)
    run = only_run(client)  # the resumed run went on in the same MLflow run
    for key in ("forget_loss", "lr"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{key}"))
        assert history == [(r["step"], r[key]) for r in rows if r.get(key) is not None], (key, kept)


@pytest.mark.processes
def test_sigterm_then_resume_continues_the_same_tracker_run(tiny_llama, data, tmp_path):
    steps = 8
    out = tmp_path / "stopped"
    command = args(tiny_llama, data, out, steps, "--report-to", "tensorboard,mlflow")
    process = launch(command)
    wait_for_steps(out, 3, process)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert run_cli(*command, "--resume") == 0
    client = mlflow_client(out)
    run = only_run(client)
    lr = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/lr"))
    assert lr == list(range(1, steps + 1))
    assert sorted(s for s, _ in tensorboard_scalars(out / "trackers" / "tensorboard")["train/lr"]) == lr


@pytest.mark.cpu_processes
def test_two_processes_log_once_with_the_values_of_one_process_at_twice_the_batch(tiny_llama, data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--report-to", "tensorboard", "--scheme", "joint"]
    assert run_cli(*args(tiny_llama, data, one, 3, *common, "--batch-size", 4)) == 0
    two_processes(args(tiny_llama, data, two, 3, *common, "--batch-size", 2))
    assert len(list((two / "trackers").rglob("events.out.tfevents.*"))) == len(
        list((one / "trackers").rglob("events.out.tfevents.*")))  # only the main process wrote
    a = tensorboard_scalars(one / "trackers" / "tensorboard")
    b = tensorboard_scalars(two / "trackers" / "tensorboard")
    for key in ("train/forget_loss", "train/retain_loss", "train/total_loss", "train/lr"):
        assert [s for s, _ in sorted(b[key])] == [1, 2, 3], key
        assert [v for _, v in sorted(b[key])] == pytest.approx([v for _, v in sorted(a[key])], rel=1e-5), key


def test_an_unknown_tracker_is_one_line_and_exit_code_2(tiny_llama, data, tmp_path, capsys):
    assert run_cli(*args(tiny_llama, data, tmp_path / "x", 2, "--report-to", "tensorboard,comet")) == 2
    err = capsys.readouterr().err.strip()
    assert "--report-to tensorboard,comet: unknown tracker 'comet'" in err and "\n" not in err


def test_a_missing_tracker_package_names_it_before_any_model_loads(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError, as when not installed
    out = tmp_path / "x"
    assert run_cli(*args(tmp_path / "no-such-model", data, out, 2, "--report-to", "mlflow")) == 2
    err = capsys.readouterr().err.strip()
    assert "--report-to mlflow: the mlflow package is not installed; pip install mlflow" in err and "\n" not in err
    assert not out.exists()


def test_all_means_every_installed_tracker(monkeypatch):
    from doplus_cli.config import chosen_trackers

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "trackio", None)
    assert chosen_trackers(("all",)) == ["tensorboard", "mlflow"]
    assert chosen_trackers(("none",)) == [] and chosen_trackers(()) == []
    assert chosen_trackers(("TensorBoard", "mlflow", "tensorboard")) == ["tensorboard", "mlflow"]


def test_a_multitask_card_writes_each_task_as_a_flag_and_parses_back(tiny_llama, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard

    rows = [{"prompt": f"{a} plus {a}?", "answer": str(2 * a)} for a in range(12)]
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mt"
    data = tmp_path / "add.jsonl"
    assert run_cli("multitask", "--model", tiny_llama, "--task", f"add={data},metric=edit_sim,weight=2",
                   "--task", f"copy={data},freq=2", "--steps", 3, "--lr", 1e-3, "--batch-size", 2,
                   "--max-length", 32, "--max-new-tokens", 2, "--eval-rows", 2, "--out", out) == 0
    card = ModelCard.load(out / "final" / "README.md")
    assert "doplus-multitask" in card.data.tags
    digest = hashlib.sha256((tmp_path / "add.jsonl").read_bytes()).hexdigest()
    assert card.text.count(digest) == 2 and "| add | " in card.text and "| copy | " in card.text
    command = re.search(r"```\n(doplus multitask .*)\n```", card.text).group(1)
    parsed = parse_back(command, monkeypatch)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    for key in ("resume", "overwrite"):
        saved.pop(key), parsed.pop(key)
    assert parsed == saved


def test_bench_schemes_names_and_groups_each_run_in_one_tracker_folder(tiny_llama, data, tofu_dir, tmp_path):
    from doplus_cli.bench.schemes import plan_bench

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "forget": str(data / "forget.jsonl"), "retain": str(data / "retain.jsonl"),
        "loss": "IDK+GD", "steps": 4, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir)}))
    out = tmp_path / "cmp"
    bench = plan_bench(str(recipe), "joint,doplus", "0,1", str(out), ["report_to=tensorboard,mlflow"],
                       "lr=0.001,0.002", False)
    assert len(bench.runs) == 8
    for run in bench.runs:
        config = run.config
        assert config.report_to == ("tensorboard", "mlflow") and config.tracker_run_name == run.name
        assert run.recipe["report_to"] == "tensorboard,mlflow"  # the run's recipe as the flag is typed
        lr = "0.001" if config.lr == 0.001 else "0.002"
        assert run.name == f"{run.scheme}-lr={lr}-s{run.seed}"
        assert config.tracker_group == f"{run.scheme}-lr={lr}"  # the seeds of one scheme and value together
        assert config.tracker_dir == str(out.resolve() / "trackers") and config.tracker_project == "doplus-bench-cmp"
    plain = plan_bench(str(recipe), "doplus", "0", str(tmp_path / "plain"), [], None, False)
    assert plain.runs[0].config.tracker_run_name is None and plain.runs[0].config.report_to == ("none",)


def test_the_users_mlflow_tracking_uri_goes_first(tiny_llama, data, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mine.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    out = tmp_path / "run"
    assert run_cli(*args(tiny_llama, data, out, 2, "--report-to", "mlflow")) == 0
    assert not (out / "trackers").exists()
    client = MlflowClient(tracking_uri=store)
    assert len(only_run(client).data.metrics) > 0
    assert os.environ["MLFLOW_TRACKING_URI"] == store  # left as the user set it


def test_continual_makes_one_tracker_run_per_task_side_by_side(tiny_llama, tofu_dir, tmp_path, monkeypatch):
    """Two forget tasks of a file whose rows carry task_id: two TensorBoard runs in OUT/trackers/, each with its
    own steps; each task's card reproduces that task's own run (from the previous task's model)."""
    from huggingface_hub import ModelCard

    folder = tmp_path / "authors"
    folder.mkdir()
    lines = {name: [json.loads(line) for line in open(tofu_dir / name) if line.strip()]
             for name in ("forget01.json", "forget01_perturbed.json", "retain90.json", "retain_perturbed.json",
                          "real_authors_perturbed.json", "world_facts_perturbed.json")}
    for name in ("forget01.json", "forget01_perturbed.json"):
        picked = [r for task in ("1", "2") for r in [r for r in lines[name] if r["task_id"] == task][:4]]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in picked))
    for name, n in (("retain90.json", 6), ("retain_perturbed.json", 2), ("real_authors_perturbed.json", 2),
                    ("world_facts_perturbed.json", 2)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in lines[name][:n]))
    out = tmp_path / "cont"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", folder / "forget01.json", "--retain", "tofu-authors",
                   "--loss", "IDK+GD", "--steps", 2, "--batch-size", 2, "--max-length", 48, "--show-samples", 0,
                   "--lr", 1e-3, "--eval-data-dir", folder, "--eval-split", "forget01", "--eval-max-new-tokens", 2,
                   "--task-ids", "1,2", "--continual", "--out", out, "--report-to", "tensorboard") == 0
    for task in (1, 2):
        scalars = tensorboard_scalars(out / "trackers" / "tensorboard" / f"cont-task-{task}")
        assert sorted(s for s, _ in scalars["train/lr"]) == [1, 2], task
        assert [s for s, _ in scalars["eval/MU"]] == [2], task
    card = ModelCard.load(out / "task-2" / "final" / "README.md").text
    command = re.search(r"```\n(doplus unlearn .*)\n```", card).group(1)
    assert "--task-id 2" in command and "--continual" not in command and str(out / "task-1" / "final") in command
    parsed = parse_back(command, monkeypatch)
    assert parsed["task_id"] == 2 and parsed["model"] == str(out / "task-1" / "final") and not parsed["continual"]
