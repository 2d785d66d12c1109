"""The teaching stage (`teach:`): taught once, cached by what decides its weights, reused by later runs."""

import json

from safetensors.torch import load_file

from tests.helpers import run_cli, write_sets


def _recipes(tmp_path, tiny_llama, tofu_dir):
    sets = write_sets(tofu_dir, tmp_path, 6, 6)
    teach = tmp_path / "teach.yaml"
    data = f"{tofu_dir / 'forget01.json'}[:12]"
    teach.write_text(
        f"model: {tiny_llama}\n"
        f"tasks:\n  - {{name: authors, data: '{data}', metric: rouge_l}}\n"
        "prompt_key: question\neval_rows: 2\nsteps: 4\nbatch_size: 2\nlr: 1.0e-3\nmax_new_tokens: 4\n"
    )
    unlearn = tmp_path / "unlearn.yaml"
    unlearn.write_text(f"teach: teach.yaml\nforget: {sets / 'forget.jsonl'}\nretain: {sets / 'retain.jsonl'}\n"
                       "steps: 2\nbatch_size: 2\nshow_samples: 0\n")
    return teach, unlearn


def test_the_teaching_stage_runs_once_and_later_runs_reuse_it(tiny_llama, tofu_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DOPLUS_CACHE", str(tmp_path / "cache"))
    teach, unlearn = _recipes(tmp_path, tiny_llama, tofu_dir)
    assert run_cli("unlearn", "--recipe", unlearn, "--out", tmp_path / "a") == 0
    first = json.loads((tmp_path / "a" / "report.json").read_text())
    assert first["teach"]["reused"] is False and first["teach"]["recipe"] == str(teach)
    taught = first["config"]["model"]
    assert taught.startswith(str(tmp_path / "cache" / "taught")) and taught.endswith("final")
    weights = load_file(f"{taught}/model.safetensors")
    base = load_file(f"{tiny_llama}/model.safetensors")
    assert any(not (weights[k] == base[k]).all() for k in base)  # the teaching changed the model
    assert not list((tmp_path / "cache" / "taught").glob("*.partial"))

    assert run_cli("unlearn", "--recipe", unlearn, "--out", tmp_path / "b", "--seed", "1") == 0
    second = json.loads((tmp_path / "b" / "report.json").read_text())
    assert second["teach"]["reused"] is True and second["config"]["model"] == taught
    assert all((load_file(f"{taught}/model.safetensors")[k] == weights[k]).all() for k in weights)

    # a change that decides the taught weights (here the teaching steps) teaches anew, into another entry
    teach.write_text(teach.read_text().replace("steps: 4", "steps: 3"))
    assert run_cli("unlearn", "--recipe", unlearn, "--out", tmp_path / "c") == 0
    third = json.loads((tmp_path / "c" / "report.json").read_text())
    assert third["teach"]["reused"] is False and third["config"]["model"] != taught


def test_teach_and_model_together_is_refused(tiny_llama, tofu_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DOPLUS_CACHE", str(tmp_path / "cache"))
    _, unlearn = _recipes(tmp_path, tiny_llama, tofu_dir)
    assert run_cli("unlearn", "--recipe", unlearn, "--model", tiny_llama, "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert "option 'teach' gives the starting model" in err and "Traceback" not in err


def test_an_option_added_at_its_default_leaves_the_key_a_cached_model_was_found_by(tmp_path, monkeypatch):
    """An option added to the configs since the key's form was fixed (`_ADDED_SINCE`) changes nothing while at its
    default, so the key is the one computed from the settings without it; set, it changes the key."""
    from doplus_cli.commands.multitask import MultitaskConfig
    from doplus_cli.config import resolve_config, task_from_option
    from doplus_cli.engine import teach

    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    config = resolve_config(None, {"tasks": [task_from_option(f"a={data}")]}, MultitaskConfig)
    key = teach.teaching_key(config)
    assert set(teach._ADDED_SINCE) <= set(config.to_dict())
    as_before = config.to_dict()
    for name in teach._ADDED_SINCE:
        del as_before[name]
    monkeypatch.setattr(MultitaskConfig, "to_dict", lambda self: dict(as_before))
    assert teach.teaching_key(config) == key
    monkeypatch.undo()
    stopping = resolve_config(None, {"tasks": [task_from_option(f"a={data}")], "eval_every": 1,
                                     "stop_when": "average>=50"}, MultitaskConfig)
    assert teach.teaching_key(stopping) != key


def test_the_key_follows_the_precision_the_machine_resolves(tmp_path, monkeypatch):
    """`auto` teaches in float32 on a CPU and in bf16-mixed, saved in bfloat16, on a GPU: two models, two keys, so
    that a cache shared by both never hands one the other's model. float32 said outright is the CPU's `auto`: one
    key on either machine, the one keys had before the precision entered them."""
    import torch

    from doplus_cli.commands.multitask import MultitaskConfig
    from doplus_cli.config import resolve_config, task_from_option
    from doplus_cli.engine import teach

    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")

    def key(**values):
        return teach.teaching_key(resolve_config(None, {"tasks": [task_from_option(f"a={data}")], **values},
                                                 MultitaskConfig))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = key()
    assert key(precision="fp32", dtype="float32") == cpu
    assert key(precision="bf16-mixed", dtype="bfloat16") != cpu
    with monkeypatch.context() as before:  # the key as computed before the precision entered it
        before.setattr(teach, "_resolved_precision", lambda config: {})
        assert key() == cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert key() != cpu  # bf16-mixed here
    assert key(precision="fp32", dtype="float32") == cpu
    assert key(precision="fp32", dtype="float32", save_dtype="bfloat16") != cpu
