"""`doplus align`: the two objectives on the one loop, the cycle, --epochs, the joint mixture, Alpaca prompts and
their label masks, the report, the evaluation after training, bad input and the bench."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from doplus_cli.bench.adapters import adapter_of
from doplus_cli.bench.adapters.align import AlignAdapter
from doplus_cli.commands.align import AlignConfig, alpaca_keys, epoch_steps
from doplus_cli.config import resolve_config
from doplus_cli.data.batches import build_batch
from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.data.sources import MixtureSource, RowRange, open_source
from doplus_cli.errors import UserError
from doplus_cli.losses import LossContext, PartTally, mean_ce, supervised_cross_entropy
from doplus_cli.models import load_model_and_tokenizer
from tests.helpers import GENERAL, SAFETY, SAFETY_DIR, align_args, max_difference, run_cli, two_processes, weights


def read_metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


# ---- the schemes, the cycle and the report ----

@pytest.mark.parametrize("scheme", ["alternate", "dualoptim", "doplus"])
def test_each_alternating_scheme_follows_the_1_10_cycle_and_reports_both_losses(tiny_llama, tmp_path, scheme):
    out = tmp_path / scheme
    assert run_cli(*align_args(tiny_llama, out, "--scheme", scheme, "--steps", 13)) == 0
    records = read_metrics(out)
    assert [r["objective"] for r in records] == ["safety"] + ["general"] * 10 + ["safety", "general"]
    assert all(("safety_loss" in r) == (r["objective"] == "safety") for r in records)
    assert all(("general_loss" in r) == (r["objective"] == "general") for r in records)
    report = json.loads((out / "report.json").read_text())
    assert report["steps_per_objective"] == {"safety": 2, "general": 11} and report["cycle"] == [1, 10]
    assert report["losses"]["safety"]["safety_loss"]["end"] == records[11]["safety_loss"]
    assert report["losses"]["general"]["general_loss"]["start"] == records[1]["general_loss"]
    assert report["data"]["safety"]["train_rows"] == 12 and report["data"]["general"]["held_out_rows"] == 2
    markdown = (out / "report.md").read_text()
    assert markdown.startswith(f"# doplus align: safety + general with {scheme}")
    assert "| safety_loss | safety steps |" in markdown and "| general_loss | general steps |" in markdown
    assert "cycle F_s:F_g = 1:10" in markdown


def test_freq_sets_the_cycle(tiny_llama, tmp_path):
    out = tmp_path / "freq"
    assert run_cli(*align_args(tiny_llama, out, "--freq", "2:3", "--steps", 7, "--held-out", 0)) == 0
    assert [r["objective"] for r in read_metrics(out)] == ["safety"] * 2 + ["general"] * 3 + ["safety"] * 2


def test_joint_steps_draw_from_the_mixture_and_log_both_losses(tiny_llama, tmp_path):
    """One epoch over the mixture of 12 safety and 24 general rows at batch 4 is 9 joint steps, whose batches hold
    every row once: 12 safety rows and 24 general rows in all, mixed within batches (not one set per batch)."""
    out = tmp_path / "joint"
    assert run_cli(*align_args(tiny_llama, out, "--scheme", "joint", "--epochs", 1, "--batch-size", 4)) == 0
    records = read_metrics(out)
    assert len(records) == math.ceil((12 + 24) / 4) == 9
    assert {r["objective"] for r in records} == {"joint"}
    assert sum(r["safety_rows"] for r in records) == 12 and sum(r["general_rows"] for r in records) == 24
    assert all(r["safety_rows"] + r["general_rows"] == 4 for r in records)
    assert any(0 < r["safety_rows"] < 4 for r in records)
    for r in records:  # a set's loss is logged exactly when the batch drew rows of it
        assert (r["safety_loss"] is not None) == (r["safety_rows"] > 0)
        assert (r["general_loss"] is not None) == (r["general_rows"] > 0)
        if r["safety_rows"] == 0:
            assert r["general_loss"] == pytest.approx(r["mixture_loss"], rel=1e-5)
    report = json.loads((out / "report.json").read_text())
    assert set(report["losses"]["joint"]) >= {"safety_loss", "general_loss", "mixture_loss"}
    markdown = (out / "report.md").read_text()
    assert "| safety_loss | joint steps |" in markdown and "| general_loss | joint steps |" in markdown
    assert "each step one batch from the mixture of both sets" in markdown


@pytest.mark.cpu_processes
def test_joint_mixture_on_two_processes_logs_the_global_batchs_per_set_losses(tiny_llama, tmp_path):
    """Two processes at batch 2 draw the rows one process draws at batch 4, and the per-set split is reduced over
    both: the same rows per set and the same token-mean per-set losses at every step, and the same weights."""

    one, two = tmp_path / "one", tmp_path / "two"
    base = ["--scheme", "joint", "--steps", 4, "--save-every", 0]
    assert run_cli(*align_args(tiny_llama, one, *base, "--batch-size", 4)) == 0
    two_processes(align_args(tiny_llama, two, *base, "--batch-size", 2))
    assert json.loads((two / "report.json").read_text())["environment"]["world_size"] == 2
    first, second = read_metrics(one), read_metrics(two)
    assert len(first) == len(second) == 4
    assert any(0 < r["safety_rows"] < 4 for r in first)  # mixed batches: the split is not trivial
    for a, b in zip(first, second):
        assert (a["safety_rows"], a["general_rows"]) == (b["safety_rows"], b["general_rows"])
        for key in ("safety_loss", "general_loss", "mixture_loss"):
            assert (a[key] is None) == (b[key] is None)
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-5)
    assert max_difference(weights(one), weights(two)) < 1e-5


def test_the_mixture_sampler_and_its_per_set_losses(tiny_llama):
    """MixtureSource maps rows to their set by hand; the per-set losses a joint step logs are each set's own CE,
    and the trained loss stays the CE over the whole batch."""
    keys = alpaca_keys(AlignConfig())
    safety, general = open_source(f"{SAFETY}[0:3]", "safety", keys), open_source(f"{GENERAL}[0:5]", "general", keys)
    mixture = MixtureSource([("safety", safety), ("general", general)])
    assert len(mixture) == 8 and [mixture.part_of(i) for i in range(8)] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert mixture[4] == general[1] and mixture[2] == safety[2]

    model, tokenizer, _ = load_model_and_tokenizer(str(tiny_llama), "float32", False)
    formatter = PromptFormatter(tokenizer, 48)
    rows = [1, 5, 2, 7]  # safety 1, general 2, safety 2, general 4
    batch = build_batch(mixture, rows, formatter, with_rejection=False, seed=0)
    assert batch["part"]["index"].tolist() == [0, 1, 0, 1]
    context = LossContext(model, tally=PartTally(("safety", "general")))
    with torch.no_grad():
        loss = supervised_cross_entropy(context, batch)
        alone = {name: mean_ce(model, build_batch(source, picked, formatter, with_rejection=False, seed=0)["answer"])
                 for name, source, picked in (("safety", safety, [1, 2]), ("general", general, [2, 4]))}
        whole = mean_ce(model, batch["answer"])
    terms = context.tally.terms()
    assert terms["safety_rows"] == 2 and terms["general_rows"] == 2
    assert terms["safety_loss"] == pytest.approx(alone["safety"].item(), rel=1e-5)
    assert terms["general_loss"] == pytest.approx(alone["general"].item(), rel=1e-5)
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)


# ---- --epochs ----

def test_epoch_steps_by_hand():
    # the demo: 100 safety and 171 general rows at batch 8, 1:10. S_g = ceil(171 / 8) = 22 general steps,
    # then ceil(22 / 10) = 3 cycles each with 1 safety step: 25
    assert epoch_steps(1, 100, 171, 8, "doplus", (1, 10)) == 25
    # the paper: 2,000 and 20,000 rows, effective batch 128, 3 epochs: S_g = ceil(60000 / 128) = 469,
    # 47 cycles: 469 + 47 = 516; joint: ceil(3 x 22000 / 128) = 516 as well
    assert epoch_steps(3, 2000, 20000, 128, "alternate", (1, 10)) == 516
    assert epoch_steps(3, 2000, 20000, 128, "joint", (1, 10)) == 516
    # 2:5, 11 general rows at batch 2, 2 epochs: S_g = 11, ceil(11 / 5) = 3 cycles of 2 safety steps: 17
    assert epoch_steps(2, 4, 11, 2, "dualoptim", (2, 5)) == 17
    # exact arithmetic: 0.3 x 10 rows / batch 3 is 1 step, not ceil(1.0000000000000002) = 2
    assert epoch_steps(0.3, 10, 10, 3, "joint", (1, 10)) == math.ceil(0.3 * 20 / 3) == 2
    assert epoch_steps(0.3, 5, 10, 3, "doplus", (1, 10)) == 1 + 1


def test_epochs_set_the_steps_and_the_first_epoch_warms_up(tiny_llama, tmp_path):
    """24 general rows at batch 4: 6 general steps per epoch, 1 safety step before them; 2 epochs: 12 general
    steps and 2 safety steps (the second cycle starts at step 12), warmup 7 steps (the first epoch)."""
    out = tmp_path / "epochs"
    assert run_cli(*align_args(tiny_llama, out, "--epochs", 2, "--batch-size", 4, "--held-out", 2)) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 14 and report["warmup_steps"] == 7 and report["epochs"] == 2
    assert report["steps_per_objective"] == {"safety": 2, "general": 12}
    records = read_metrics(out)
    assert [r["objective"] for r in records] == ["safety"] + ["general"] * 10 + ["safety"] + ["general"] * 2
    peak = 1e-3  # linear warmup over 7 steps, then linear decay to 0 at step 14
    assert [r["lr"] for r in records] == pytest.approx([peak * k / 7 for k in range(7)]
                                                      + [peak * (14 - k) / 7 for k in range(7, 14)])
    assert "14 steps = 2 epoch(s) over the general set" in (out / "report.md").read_text()


def test_a_flag_replaces_the_recipes_other_length_option(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"safety: {SAFETY}\ngeneral: {GENERAL}\nepochs: 3\n")
    assert resolve_config(str(recipe), {"steps": 5}, AlignConfig).epochs is None
    config = resolve_config(str(recipe), {}, AlignConfig)
    assert config.epochs == 3.0 and config.freq == "1:10"


# ---- prompts and label masks ----

def test_instruction_and_input_make_one_prompt_and_only_the_response_is_scored(tiny_chat_llama, tmp_path):
    rows = [{"instruction": "Translate the sentence.", "input": "Bonjour le monde.", "output": "Hello world."},
            {"instruction": "Name a colour.", "input": "", "output": "Blue."}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    source = open_source(str(path), "general", alpaca_keys(AlignConfig()))
    assert source[0].question == "Translate the sentence.\n\nBonjour le monde."
    assert source[1].question == "Name a colour."  # an empty input adds nothing
    seed_task = open_source(f"{GENERAL}[1:2]", "general", alpaca_keys(AlignConfig()))[0]  # instances[0]
    assert seed_task.question == "What is the relation between the given pairs?\n\nNight : Day :: Right : Left"
    assert seed_task.answer == "The relation between the given pairs is that they are opposites."

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    formatter = PromptFormatter(tokenizer, max_length=128)
    assert formatter.prompt_text(source[0].question) == \
        "<|user|>\nTranslate the sentence.\n\nBonjour le monde.</s>\n<|assistant|>\n"
    batch = build_batch(source, [0], formatter, with_rejection=False, seed=0)["answer"]
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    prompt = tokenizer("<|user|>\nTranslate the sentence.\n\nBonjour le monde.</s>\n<|assistant|>\n",
                       add_special_tokens=False)["input_ids"]
    response = tokenizer("Hello world.</s>", add_special_tokens=False)["input_ids"]
    assert ids == prompt + response
    assert labels == [IGNORE_INDEX] * len(prompt) + response


# ---- the evaluation after training ----

@pytest.mark.processes
def test_eval_suite_runs_doplus_evaluate_on_final(tiny_llama, tmp_path):
    out = tmp_path / "evaluated"
    assert run_cli(*align_args(tiny_llama, out, "--steps", 2, "--eval-suite", "safety", "--eval-max-samples", 1,
                               "--eval-max-new-tokens", 4, "--eval-guard-model", "none",
                               "--eval-safety-data-dir", SAFETY_DIR, "--eval-attacks", "probe-prefix")) == 0
    summary = json.loads((out / "eval" / "SAFETY_SUMMARY.json").read_text())
    report = json.loads((out / "report.json").read_text())
    rows = {row[0]: row for row in report["evaluation"]["suites"]["safety"]["rows"]}
    assert set(rows) == {"I-Mali", "I-CoNa", "I-Cont", "Q-Harm", "AVG"} and rows["I-Mali"][1] == 1
    assert rows["AVG"][2] == summary["safety_rate_avg"]
    # --eval-attacks: the safety suite again through prefix injection, its rate beside final/'s
    attacked = json.loads((out / "eval" / "attacks" / "probe-prefix" / "SAFETY_SUMMARY.json").read_text())
    [row] = report["evaluation"]["attacks"]
    assert (row["suite"], row["metric"], row["recovered_when"]) == ("safety", "safety_rate_avg", "lower")
    assert row["unattacked"] == summary["safety_rate_avg"]
    assert row["attacks"]["probe-prefix"]["value"] == attacked["safety_rate_avg"]
    assert "## Evaluation of final/" in (out / "report.md").read_text()


# ---- bad input: one line, exit code 2, nothing written ----

@pytest.mark.parametrize("case,needle", [
    ("missing_file", "nope.jsonl: file not found"),
    ("malformed_line", "safety set: BAD:2: malformed JSON"),
    ("malformed_array", "BAD:3: malformed JSON"),
    ("missing_output", "general set: BAD:3: missing field 'output' (set --output-key"),
    ("missing_instruction", "safety set: BAD:1: missing field 'instruction' (set --instruction-key"),
    ("array_missing_output", "BAD:6: element 2: missing field 'output'"),
    ("steps_and_epochs", "--steps 3 and --epochs 1.0: give one or the other"),
    ("recipe_steps_and_epochs", "r.yaml: steps and epochs: give one or the other"),
    ("no_safety", "no safety set: pass --safety FILE"),
    ("bad_freq", "--freq 1:0: write F_s:F_g"),
    ("too_few_rows", "the safety set has 2 rows and --held-out 2 would keep every one"),
    # the evaluation's prompt files are read before training, not found missing after it
    ("eval_data_missing", "--eval-suite safety,xstest: EMPTY/I-MaliciousInstructions.json: file not found"),
    ("eval_offline", "--eval-suite xstest: https://raw.githubusercontent.com/paul-rottger/exaggerated-safety/main/"
                     "xstest_prompts.csv: offline (HF_HUB_OFFLINE is set) and not cached; pass --eval-safety-data-dir"),
    ("eval_attacks_no_safety", "--eval-attacks needs --eval-suite safety"),
    ("eval_attacks_probe", "attack 'probe-roleplay' cannot be applied to suite safety"),
    ("eval_attacks_relearn", "--eval-attacks relearn: relearning an aligned model needs harmful text"),
])
def test_bad_input_is_one_line_with_exit_code_2(tiny_llama, tmp_path, capsys, monkeypatch, case, needle):
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    good = {"instruction": "Name a colour.", "output": "Blue."}
    safety, general, length, extra = f"{SAFETY}[0:6]", f"{GENERAL}[0:6]", ["--steps", 1], []
    if case == "missing_file":
        safety = str(tmp_path / "nope.jsonl")
    elif case == "malformed_line":
        bad.write_text(json.dumps(good) + "\n" + '{"instruction": "x", "output": }\n')
        safety = str(bad)
    elif case == "malformed_array":
        bad = tmp_path / "bad.json"
        bad.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": "d"}\n]\n')
        general = str(bad)
    elif case == "missing_output":
        bad.write_text("".join(json.dumps(r) + "\n" for r in (good, good, {"instruction": "x", "input": "y"})))
        general = str(bad)
    elif case == "missing_instruction":
        bad.write_text(json.dumps({"prompt": "x", "output": "y"}) + "\n")
        safety = str(bad)
    elif case == "array_missing_output":
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps([good, {"instruction": "x"}], indent=1))
        safety = str(bad)
    elif case == "steps_and_epochs":
        length = ["--steps", 3, "--epochs", 1]
    elif case == "recipe_steps_and_epochs":
        (tmp_path / "r.yaml").write_text("steps: 3\nepochs: 1\n")
        length, extra = [], ["--recipe", tmp_path / "r.yaml"]
    elif case == "no_safety":
        safety = None
    elif case == "bad_freq":
        extra = ["--freq", "1:0"]
    elif case == "too_few_rows":
        safety = f"{SAFETY}[0:2]"
    elif case == "eval_data_missing":
        (tmp_path / "empty").mkdir()
        extra = ["--eval-suite", "safety,xstest", "--eval-safety-data-dir", tmp_path / "empty"]
    elif case == "eval_offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("DOPLUS_CACHE", str(tmp_path / "cache"))  # nothing downloaded before
        extra = ["--eval-suite", "xstest"]
    elif case.startswith("eval_attacks"):
        attack = {"eval_attacks_no_safety": "quant-4bit", "eval_attacks_probe": "probe-roleplay",
                  "eval_attacks_relearn": "relearn"}[case]
        suite = [] if case == "eval_attacks_no_safety" else ["--eval-suite", "safety"]
        extra = [*suite, "--eval-safety-data-dir", SAFETY_DIR, "--eval-attacks", attack]
    args = ["align", "--model", tiny_llama, *(["--safety", safety] if safety else []), "--general", general,
            "--held-out", 2, *length, "--out", out, *extra]
    needle = needle.replace("BAD", str(bad)).replace("EMPTY", str(tmp_path / "empty"))
    capsys.readouterr()
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert err.startswith("error:") and err.count("\n") == 0 and "Traceback" not in err
    assert not out.exists()


# ---- doplus bench schemes over an align recipe ----

@pytest.mark.processes
def test_bench_schemes_runs_an_align_recipe(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = tmp_path / "align.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "safety": f"{SAFETY}[0:14]", "general": f"{GENERAL}[0:26]", "held_out": 2,
        "epochs": 1, "batch_size": 2, "max_length": 48, "max_new_tokens": 4, "lr": 1e-3}))
    assert isinstance(adapter_of(recipe, {"safety", "general"}), AlignAdapter)
    assert AlignAdapter().planned_steps(resolve_config(str(recipe), {}, AlignConfig)) == 12 + 2  # 12 general, 2 safety
    out = tmp_path / "bench"
    assert run_cli("bench", "schemes", "--recipe", recipe, "--schemes", "joint,doplus", "--seeds", 0,
                   "--set", "steps=4", "--out", out) == 0
    assert [r["objective"] for r in read_metrics(out / "runs" / "doplus-s0")] == ["safety"] + ["general"] * 3
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert summary["kind"] == "align" and [row["scheme"] for row in summary["rows"]] == ["joint", "doplus"]
    columns = [c["key"] for c in summary["columns"]]
    assert columns[:4] == ["held_out_safety_refusal", "held_out_general_refusal", "safety_loss", "general_loss"]
    report = json.loads((out / "runs" / "joint-s0" / "report.json").read_text())
    joint = summary["rows"][0]["metrics"]
    assert joint["safety_loss"]["mean"] == report["losses"]["joint"]["safety_loss"]["end_mean10"]
    assert report["steps"] == 4 and report["config"]["epochs"] is None  # --set steps replaced the recipe's epochs
    assert (out / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="no evaluation: held_out is 0 and there is no eval_suite"):
        AlignAdapter().check_evaluation(set(), AlignConfig(held_out=0), recipe)


def test_bench_set_none_is_a_value_and_null_unsets(tiny_llama, tmp_path):
    """`--set eval_guard_model=none` means no guard model; it once became None, which tries the default 8B guard."""
    from doplus_cli.bench.schemes import plan_bench

    recipe = tmp_path / "align.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "safety": f"{SAFETY}[0:14]",
                                      "general": f"{GENERAL}[0:26]", "steps": 2, "eval_max_samples": 3}))
    bench = plan_bench(str(recipe), "doplus", "0", str(tmp_path / "bench"),
                       ["eval_guard_model=none", "eval_max_samples=null"], None, False)
    assert bench.set_values == {"eval_guard_model": "none", "eval_max_samples": None}


def test_a_row_range_of_the_shared_safety_file_is_read_as_it_is():
    source = open_source(f"{SAFETY}[0:200]", "safety", alpaca_keys(AlignConfig()))
    assert isinstance(source, RowRange) and len(source) == 200
    first = json.loads(SAFETY.read_text())[0]
    assert (source[0].question, source[0].answer) == (first["instruction"], first["output"])
