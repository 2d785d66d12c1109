"""`doplus multitask` and the N-objective engine: schedule, objectives per step, states, report, resume, metrics,
bad input."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.commands.multitask import MultitaskConfig, run_multitask
from doplus_cli.config import resolve_config, task_from_option
from doplus_cli.data import sources
from doplus_cli.engine.schedule import objective_at, steps_per_objective
from doplus_cli.evaluation.task_metrics import (
    TASK_METRICS,
    choice_match,
    edit_similarity,
    exact_match,
    normalize_answer,
    option_letter,
    rouge_l_f1,
    task_score,
)
from doplus_cli.optim import DualOptimPlus
from tests.helpers import launch, max_difference, run_cli, two_processes, wait_for_steps, weights, write_jsonl


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Three small task files in the TRACE layout {"prompt", "answer"}: sums, option letters, code lines."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    math_rows, choice_rows, code_rows = [], [], []
    for i in range(14):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        math_rows.append({"prompt": f"Tom has {a} apples and buys {b} more. How many apples?", "answer": str(a + b)})
        letter = "ABCD"[i % 4]
        choice_rows.append({"prompt": f"Which option is {letter}? A) one B) two C) three D) four",
                            "answer": letter})
        code_rows.append({"prompt": f"def f{i}(x):\n    y = x + {i}", "answer": f"    return y * {i}"})
    return {"math": write_jsonl(folder / "math.jsonl", math_rows),
            "sci": write_jsonl(folder / "sci.jsonl", choice_rows),
            "code": write_jsonl(folder / "code.jsonl", code_rows)}


def task_args(tasks, *extra):
    return ["--task", f"math={tasks['math']},metric=exact", "--task", f"sci={tasks['sci']},metric=choice",
            "--task", f"code={tasks['code']},metric=edit_sim", *extra]


def mt_args(model, tasks, out, *extra):
    return ["multitask", "--model", model, *task_args(tasks), "--steps", 8, "--lr", 1e-3, "--batch-size", 2,
            "--max-length", 48, "--max-new-tokens", 6, "--eval-rows", 4, "--out", out, *extra]


# ---- the schedule over N objectives ----

def test_three_objectives_with_frequencies_1_2_1_and_joint():
    cycle = [("code", 1), ("math", 2), ("sci", 1)]
    assert [objective_at(s, "doplus", cycle) for s in range(9)] == [
        "code", "math", "math", "sci", "code", "math", "math", "sci", "code"]
    assert steps_per_objective(9, "alternate", cycle) == {"code": 3, "math": 4, "sci": 2}
    assert [objective_at(s, "joint", cycle) for s in range(3)] == ["joint"] * 3
    # unlearn's forget-first F_f:F_r cycle is the two-objective case; frequency 0 never takes a step
    assert [objective_at(s, "doplus", [("forget", 1), ("retain", 5)]) for s in range(7)] == \
        ["forget"] + ["retain"] * 5 + ["forget"]
    assert steps_per_objective(4, "doplus", [("forget", 1), ("retain", 0)]) == {"forget": 4}


def test_each_step_hands_the_optimizer_the_task_its_rows_came_from(tiny_llama, tasks, tmp_path, monkeypatch):
    events = []
    read = sources.JsonlSource.__getitem__

    def spy_read(self, index):
        events.append(("read", self.path))
        return read(self, index)

    original = DualOptimPlus.step

    def spy_step(self, objective="forget", closure=None):
        events.append(("step", objective))
        return original(self, objective=objective)

    monkeypatch.setattr(sources.JsonlSource, "__getitem__", spy_read)
    monkeypatch.setattr(DualOptimPlus, "step", spy_step)
    config = resolve_config(None, {
        "model": str(tiny_llama), "tasks": [task_from_option(t) for t in task_args(tasks)[1::2]], "freq": "1,2,1",
        "steps": 9, "batch_size": 2, "grad_accum": 2, "max_length": 32, "eval_rows": 0,
        "out": str(tmp_path / "spy"),
    }, MultitaskConfig)
    run_multitask(config)
    names = {str(path): name for name, path in tasks.items()}
    steps, reads = [], set()
    for kind, value in events:
        if kind == "read":
            reads.add(names[value])
        else:
            steps.append((value, reads))
            reads = set()
    assert [objective for objective, _ in steps] == ["math", "sci", "sci", "code"] * 2 + ["math"]
    assert all(read_sets == {objective} for objective, read_sets in steps)


def test_a_joint_step_reads_one_batch_of_every_task(tiny_llama, tasks, tmp_path):
    out = tmp_path / "joint"
    assert run_cli(*mt_args(tiny_llama, tasks, out, "--scheme", "joint", "--steps", 2, "--eval-rows", 0)) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["objective"] for r in records] == ["joint", "joint"]
    for r in records:
        assert r["total_loss"] == pytest.approx(r["math_loss"] + r["sci_loss"] + r["code_loss"])


# ---- a 3-task DualOptim+ run: states, report, resume after SIGKILL ----

@pytest.mark.processes
def test_three_task_doplus_run_states_report_and_bit_identical_resume_after_sigkill(tiny_llama, tasks, tmp_path):
    reference = tmp_path / "uninterrupted"
    assert run_cli(*mt_args(tiny_llama, tasks, reference, "--save-every", 4, "--eval-every", 4)) == 0

    state = torch.load(reference / "checkpoints" / "step-4" / "optimizer.pt", weights_only=True)["state"]
    assert state and all(set(s["delta"]) == {"math", "sci", "code"} for s in state.values())  # 3 delta states
    assert all({"exp_avg", "exp_avg_sq"} <= set(s) for s in state.values())  # one base state
    n_params = len(load_file(str(tiny_llama / "model.safetensors")))
    assert len(state) == n_params

    report = json.loads((reference / "report.json").read_text())
    assert [t["name"] for t in report["tasks"]] == ["math", "sci", "code"]
    assert [t["metric"] for t in report["tasks"]] == ["exact", "choice", "edit_sim"]
    for t in report["tasks"]:
        assert t["train_rows"] == 10 and t["eval_rows"] == 4
        assert 0 <= t["before"] <= 100 and 0 <= t["after"] <= 100
        assert report["scores"]["after"][t["name"]] == t["after"]
    after = report["scores"]["after"]
    assert after["average"] == pytest.approx(sum(after[n] for n in ("math", "sci", "code")) / 3)
    assert report["steps_per_objective"] == {"math": 3, "sci": 3, "code": 2}
    assert [e["step"] for e in report["evals"]] == [4, 8] and report["evals"][-1]["code"] == after["code"]
    assert set(report["losses"]) == {"math", "sci", "code"}
    markdown = (reference / "report.md").read_text()
    assert markdown.startswith("# doplus multitask: math, sci, code with doplus") and "| **average** |" in markdown

    out = tmp_path / "killed"
    arguments = mt_args(tiny_llama, tasks, out, "--save-every", 1, "--eval-every", 4, "--steps", 24)
    full = tmp_path / "full"
    assert run_cli(*mt_args(tiny_llama, tasks, full, "--save-every", 1, "--eval-every", 4, "--steps", 24)) == 0
    process = launch(arguments)
    kill_after = random.Random(os.getpid()).randint(3, 18)
    wait_for_steps(out, kill_after, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not (out / "final").exists() and not (out / "report.json").exists()
    assert run_cli(*arguments, "--resume") == 0
    a, b = load_file(str(full / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(str(tiny_llama / "model.safetensors"))
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4  # the runs moved the weights
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (full, out))
    assert ra["scores"] == rb["scores"] and ra["evals"] == rb["evals"]
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == list(range(1, 25))


def test_one_task_alone_is_supervised_fine_tuning(tiny_llama, tasks, tmp_path):
    out = tmp_path / "sft"
    assert run_cli("multitask", "--model", tiny_llama, "--task", f"sci={tasks['sci']},metric=choice",
                   "--steps", 30, "--lr", 3e-3, "--batch-size", 4, "--eval-rows", 4, "--max-new-tokens", 3,
                   "--out", out) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert {r["objective"] for r in records} == {"sci"}
    first, last = records[0]["sci_loss"], sum(r["sci_loss"] for r in records[-5:]) / 5
    assert last < 0.75 * first


def test_recipe_tasks_and_paths_next_to_the_recipe(tasks, tmp_path):
    folder = tmp_path / "recipes"
    (folder / "d").mkdir(parents=True)
    (folder / "d" / "m.jsonl").write_text(tasks["math"].read_text())
    (folder / "r.yaml").write_text("tasks:\n  - {name: math, data: d/m.jsonl, metric: exact, freq: 2}\n"
                                   "  - {name: sci, data: " + str(tasks["sci"]) + ", metric: choice}\nsteps: 5\n")
    config = resolve_config(str(folder / "r.yaml"), {"steps": 3}, MultitaskConfig)
    assert config.steps == 3
    assert [(t["name"], t["data"], t["freq"], t["weight"]) for t in config.tasks] == [
        ("math", str(folder / "d" / "m.jsonl"), 2, 1.0), ("sci", str(tasks["sci"]), 1, 1.0)]


# ---- metrics against values computed by hand ----

def test_exact_match_normalises_case_articles_punctuation_and_numbers():
    assert normalize_answer("  The Answer, is 5.0. ") == "answer is 5.0"
    assert normalize_answer("5.0") == "5" and normalize_answer("-2.50") == "-2.5"
    assert normalize_answer("1,200") == "1200"
    assert exact_match("42", "42.0") == 1.0
    assert exact_match("The cat!", "cat") == 1.0
    assert exact_match("43", "42") == 0.0
    assert exact_match("The answer is 42", "42") == 0.0  # exact, not "contains"


def test_choice_takes_the_first_option_letter():
    assert option_letter("B") == "B" and option_letter("(C) 42") == "C" and option_letter("Answer: D.") == "D"
    assert option_letter("no capital letter alone") is None
    assert choice_match("B) because", "B") == 1.0
    assert choice_match("The answer is C", "B") == 0.0
    assert choice_match("nothing", "B") == 0.0


def test_edit_similarity_by_hand():
    # Indel distance: "abc" -> "abd" deletes c and inserts d: 2 edits over 3 + 3 characters
    assert edit_similarity("abc", "abd") == pytest.approx(1 - 2 / 6)
    # "return x" -> "return y + 1": delete x (1), insert "y + 1" (5): 6 edits over 8 + 12 characters
    assert edit_similarity("  return x", "return y + 1\n") == pytest.approx(1 - 6 / 20)
    assert edit_similarity("same", "same") == 1.0 and edit_similarity("abc", "xyz") == 0.0


def test_rouge_l_by_hand():
    # LCS of "the cat sat" and "the cat sat on the mat" is 3 words: P = 3/3, R = 3/6, F1 = 2PR/(P+R) = 2/3
    assert rouge_l_f1("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # "a b c d" vs "a c e": LCS "a c" = 2; P = 2/4, R = 2/3, F1 = 2 * (1/2 * 2/3) / (1/2 + 2/3) = 4/7
    assert rouge_l_f1("a b c d", "a c e") == pytest.approx(4 / 7)


def test_task_score_is_the_mean_and_every_metric_is_registered_with_its_formula():
    assert task_score("exact", ["1", "2", "x", "4"], ["1", "2", "3", "5"]) == pytest.approx(0.5)
    assert set(TASK_METRICS) == {"exact", "choice", "edit_sim", "rouge_l"}
    assert all(m.formula.startswith(m.name) for m in TASK_METRICS.values())


# ---- bad input: one line naming the task, file and line; exit code 2; nothing written ----

@pytest.mark.parametrize(
    "case,needle",
    [
        ("no_name", "--task 'TASKFILE': write NAME=SOURCE"),
        ("no_source", "--task 'math=': write NAME=SOURCE"),
        ("recipe_no_name", "r.yaml: task 2: a task without a name"),
        ("recipe_no_source", "r.yaml: task 1: task 'math' has no data source"),
        ("duplicate", "task 'math' is given 2 times"),
        ("freq_length", "--freq 1,1: 2 frequencies for 3 tasks (math, sci, code)"),
        ("unknown_metric", "task 'math': unknown metric 'bleu': choose one of exact, choice, edit_sim, rouge_l"),
        ("empty_file", "empty.jsonl: the task 'sci' set is empty"),
        ("missing_answer", "task 'code': BAD:3: missing field 'answer' (set --answer-key"),
        ("missing_prompt", "task 'code': BAD:2: missing field 'prompt' (set --prompt-key"),
        ("too_few_rows", "task 'math' has 14 rows and --eval-rows 20 would keep every one out"),
        ("no_tasks", "no tasks: pass --task NAME=FILE.jsonl"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(tiny_llama, tasks, tmp_path, capsys, case, needle):
    out = tmp_path / "out"
    specs = [f"math={tasks['math']}", f"sci={tasks['sci']},metric=choice", f"code={tasks['code']},metric=edit_sim"]
    extra, recipe, eval_rows = [], None, 4
    bad = tmp_path / "bad.jsonl"
    if case == "no_name":
        specs[0] = str(tasks["math"])
        needle = needle.replace("TASKFILE", str(tasks["math"]))
    elif case == "no_source":
        specs[0] = "math="
    elif case in ("recipe_no_name", "recipe_no_source"):
        entries = ([{"name": "math", "data": str(tasks["math"])}, {"data": str(tasks["sci"])}]
                   if case == "recipe_no_name" else [{"name": "math"}])
        recipe = tmp_path / "r.yaml"
        recipe.write_text(json.dumps({"tasks": entries}))
        specs = []
    elif case == "duplicate":
        specs[1] = f"math={tasks['sci']}"
    elif case == "freq_length":
        extra = ["--freq", "1,1"]
    elif case == "unknown_metric":
        specs[0] += ",metric=bleu"
    elif case == "empty_file":
        specs[1] = f"sci={write_jsonl(tmp_path / 'empty.jsonl', [])}"
    elif case == "missing_answer":
        write_jsonl(bad, [{"prompt": "p", "answer": "a"}, {"prompt": "p", "answer": "b"}, {"prompt": "p"}])
        specs[2] = f"code={bad}"
        needle = needle.replace("BAD", str(bad))
    elif case == "missing_prompt":
        write_jsonl(bad, [{"prompt": "p", "answer": "a"}, {"question": "p", "answer": "b"}])
        specs[2] = f"code={bad}"
        needle = needle.replace("BAD", str(bad))
    elif case == "too_few_rows":
        eval_rows = 20
    elif case == "no_tasks":
        specs = []
    args = ["multitask", "--model", tiny_llama, *[x for s in specs for x in ("--task", s)], "--steps", 1,
            "--eval-rows", eval_rows, "--out", out, *extra]
    if recipe is not None:
        args += ["--recipe", recipe]
    capsys.readouterr()
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert err.count("\n") == 0 and "Traceback" not in err
    assert not out.exists()  # nothing half-written


def test_trace_json_array_files_are_read_as_they_are(tmp_path):
    from doplus_cli.data.sources import Keys, open_source
    from doplus_cli.errors import UserError

    keys = Keys("prompt", "answer", text_rows=False, question_flag="--prompt-key")
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}], indent=1))
    source = open_source(str(path), "task 'math'", keys)
    assert len(source) == 2 and (source[1].question, source[1].answer) == ("2+2=", "4")
    path.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]))
    with pytest.raises(UserError, match="train.json:1: element 2: missing field 'answer'"):
        open_source(str(path), "task 'math'", keys)


# ---- N objectives through the rest of the engine: processes, sharding, LoRA, 8-bit states ----

@pytest.mark.cpu_processes
@pytest.mark.parametrize("extra,tolerance", [([], 1e-5), (["--fsdp"], 1e-5), (["--state-bits", "8"], 1e-5)],
                         ids=["ddp", "fsdp", "ddp-8bit"])
def test_three_tasks_on_two_processes_at_batch_b_equal_one_process_at_2b(tiny_llama, tasks, tmp_path, extra,
                                                                          tolerance):
    """The N-objective schedule under DDP and FSDP: every process takes the same task at each step, and the
    averaged gradients of 2 x b rows are one process's gradients of 2b rows."""

    one, two = tmp_path / "one", tmp_path / "two"
    base = ["--steps", 6, "--save-every", 0]
    unsharded = [e for e in extra if e != "--fsdp"]  # FSDP needs two processes: the one-process run is its reference
    assert run_cli(*mt_args(tiny_llama, tasks, one, *base, "--batch-size", 4, *unsharded)) == 0
    two_processes(mt_args(tiny_llama, tasks, two, *base, "--batch-size", 2, *extra))
    report = json.loads((two / "report.json").read_text())
    assert report["environment"]["world_size"] == 2 and report["environment"]["effective_batch"] == 4
    records = [json.loads(line) for line in open(two / "metrics.jsonl")]
    assert [r["objective"] for r in records] == ["math", "sci", "code"] * 2
    start = load_file(str(tiny_llama / "model.safetensors"))
    assert max_difference(weights(one), start) > 1e-4  # the runs moved the weights
    assert max_difference(weights(one), weights(two)) < tolerance
    assert report["scores"]["after"].keys() == {"math", "sci", "code", "average"}


def test_three_tasks_with_lora_and_8bit_states(tiny_llama, tasks, tmp_path):
    """LoRA adapters with DualOptim+ 8-bit states over three tasks: only adapters have states, each with its
    base and three delta states, 8-bit wherever the adapter has 4,096 elements or more (rank 128 on the
    32-wide model makes most of them that large), and the merged model differs from the start only through
    the adapters."""
    out = tmp_path / "lora"
    # float32 weights on every device: CUDA's default saves bf16, where every tensor differs from the float32 start
    assert run_cli(*mt_args(tiny_llama, tasks, out, "--lora-rank", 128, "--state-bits", 8, "--save-every", 4,
                            "--dtype", "float32")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["lora"]["rank"] == 128 and report["config"]["state_bits"] == 8
    state = torch.load(out / "checkpoints" / "step-4" / "optimizer.pt", weights_only=False)["state"]
    trainable = load_file(str(out / "checkpoints" / "step-4" / "model.safetensors"))
    assert trainable and all("lora_" in k for k in trainable) and len(state) == len(trainable)
    assert all(set(s["delta"]) == {"math", "sci", "code"} for s in state.values())
    eight_bit = 0
    for s in state.values():
        large = s["exp_avg"].numel() >= 4096
        for stored in (s, *s["delta"].values()):
            assert (stored["exp_avg"].dtype == torch.uint8) == large
            assert (stored["exp_avg_sq"].dtype == torch.uint8) == large
        eight_bit += large
    assert eight_bit >= len(state) // 2, (eight_bit, len(state))  # really 8-bit states, not all fp32
    start, final = load_file(str(tiny_llama / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    changed = {k for k in start if not torch.equal(start[k], final[k])}
    assert changed and all(("proj" in k) for k in changed)  # adapted projections only; embeddings, norms unchanged


def test_a_task_of_raw_text_trains_on_every_token(tiny_llama, tmp_path, capsys):
    """Rows with only a `text` field: the task's loss is the CE of every token after the first (BOS included in
    the input), computed here in float64 on the first step's one row; such a task takes no held-out evaluation."""
    text = "The forgotten author was born in Kuwait City in 1956 and writes detective novels."
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text}])
    out = tmp_path / "text"
    assert run_cli("multitask", "--model", tiny_llama, "--task", f"corpus={corpus}", "--steps", 1, "--lr", 1e-3,
                   "--batch-size", 1, "--max-length", 64, "--eval-rows", 0, "--dtype", "float32",
                   "--out", out) == 0
    [record] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float64).eval()
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)
    expected = -sum(log_probs[t - 1, ids[t]].item() for t in range(1, len(ids))) / (len(ids) - 1)
    assert record["corpus_loss"] == pytest.approx(expected, rel=1e-4)

    capsys.readouterr()
    assert run_cli("multitask", "--model", tiny_llama, "--task", f"corpus={corpus}", "--steps", 1,
                   "--eval-rows", 2, "--out", tmp_path / "refused") == 2
    err = capsys.readouterr().err.strip()
    assert "task 'corpus' has 1 row with only a 'text' field" in err and "--eval-rows 0" in err
    assert err.count("\n") == 0 and not (tmp_path / "refused").exists()
