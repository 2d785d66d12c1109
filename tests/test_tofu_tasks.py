"""TOFU as the DualOptim+ authors run it: one forget task of a file whose rows carry task_id, their retain set,
their warm-up, the paper protocol's 300-row cap, continual unlearning and forget tasks as a bench axis."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli.commands.unlearn import UnlearnCommand, UnlearnConfig
from doplus_cli.engine.schedule import authors_epoch_steps, authors_warmup
from doplus_cli.evaluation.suites import load_tofu_sets
from tests.helpers import run_cli

PER_TASK = 4  # rows of each task in the small authors-layout folder


def _rows(path, n=None):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return rows if n is None else rows[:n]


@pytest.fixture(scope="module")
def authors_dir(tofu_dir, tmp_path_factory):
    """A small folder in the authors' layout: forget01.json and forget01_perturbed.json with tasks 1-3 (4 rows
    each, the first rows of those tasks in ../shared), retain90.json (6 rows) and the three other evaluation sets."""
    folder = tmp_path_factory.mktemp("authors")
    for name in ("forget01.json", "forget01_perturbed.json"):
        picked = []
        for task in ("1", "2", "3"):
            picked += [r for r in _rows(tofu_dir / name) if r["task_id"] == task][:PER_TASK]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in picked))
    for name, n in (("retain90.json", 6), ("retain_perturbed.json", 3), ("real_authors_perturbed.json", 2),
                    ("world_facts_perturbed.json", 2)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in _rows(tofu_dir / name, n)))
    return folder


def _task_questions(path, task):
    return [r["question"] for r in _rows(path) if int(r["task_id"]) == task]


def test_task_2_trains_on_its_rows_and_keeps_the_retain_split_plus_the_other_tasks(authors_dir):
    config = UnlearnConfig(forget=str(authors_dir / "forget01.json"), retain="tofu-authors", task_id=2,
                           loss="IDK+GD")
    plan = UnlearnCommand(config)
    plan.open()
    forget = [plan.forget_source[i].question for i in range(len(plan.forget_source))]
    assert forget == _task_questions(authors_dir / "forget01.json", 2)
    retain = [plan.retain_source[i].question for i in range(len(plan.retain_source))]
    expected = ([r["question"] for r in _rows(authors_dir / "retain90.json")]
                + _task_questions(authors_dir / "forget01.json", 1) + _task_questions(authors_dir / "forget01.json", 3))
    assert retain == expected and len(retain) == 6 + 2 * PER_TASK
    assert not set(forget) & set(retain)


def test_the_authors_retain_set_on_the_shared_files_is_every_row_outside_the_task(tofu_dir):
    """The issue's check: for task 1 the retain set holds 3,960, 3,800 and 3,600 rows, none of them in the task."""
    for split, expected in (("forget01", 3960), ("forget05", 3800), ("forget10", 3600)):
        plan = UnlearnCommand(UnlearnConfig(forget=str(tofu_dir / f"{split}.json"), retain="tofu-authors",
                                         loss="IDK+GD"))
        plan.open()
        assert len(plan.retain_source) == expected
        assert len(plan.forget_source) == {"forget01": 40, "forget05": 200, "forget10": 400}[split]
        assert plan.task["task_id"] == 1 and not plan.task["task_given"]


def test_unlearn_reports_the_task_and_the_retain_parts(tiny_llama, authors_dir, tmp_path):
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", authors_dir / "forget01.json", "--retain",
                   "tofu-authors", "--task-id", 2, "--loss", "IDK+GD", "--scheme", "alternate", "--steps", 2,
                   "--batch-size", 2, "--max-length", 48, "--show-samples", 0, "--out", out) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["forget_rows"] == PER_TASK and report["data"]["retain_rows"] == 6 + 2 * PER_TASK
    assert report["data"]["task"]["task_id"] == 2 and report["data"]["task"]["file_tasks"] == [1, 2, 3]
    assert [p["rows"] for p in report["data"]["retain"]["parts"]] == [6, 2 * PER_TASK]
    # the authors' warm-up: ceil(4/1)=4 <= ceil(14/5)=3 is false, so (1 + 1/5) * ceil(14/2) = 8 (truncated)
    assert report["data"]["epoch_steps"] == 8 and report["warmup_steps"] == 2  # capped at --steps
    text = (out / "report.md").read_text()
    assert "task 2 of the file's tasks 1, 2, 3" in text and "the authors' retain set" in text
    # `doplus evaluate` of the run's final/ scores the task it unlearned, without being told
    assert run_cli("evaluate", "--model", out / "final", "--data-dir", authors_dir, "--split", "forget01",
                   "--max-new-tokens", 2, "--out", tmp_path / "eval") == 0
    records = json.loads((tmp_path / "eval" / "TOFU_EVAL.json").read_text())["sets"]["forget"]
    assert [r["question"] for r in records] == _task_questions(authors_dir / "forget01_perturbed.json", 2)


@pytest.mark.parametrize("scheme,forget,retain,f_f,f_r,batch,accum,processes,epoch", [
    # forget10 task 1 at 1:5 and the paper's effective batch 40 (2 GPUs x 4 x 5): (1 + 5) * ceil(400 / 40) = 60
    ("doplus", 400, 3600, 1, 5, 4, 5, 2, 60),
    ("alternate", 200, 3800, 1, 5, 4, 5, 2, 30),  # forget05: (1 + 5) * ceil(200 / 40)
    ("joint", 400, 3600, 1, 5, 4, 5, 2, 10),  # joint: ceil(400 / 40)
    # the retain side runs out first: ceil(100/1) > ceil(20/5), so (1 + 1/5) * ceil(20 / 4) = 6
    ("dualoptim", 100, 20, 1, 5, 2, 2, 1, 6),
    ("doplus", 10, 100, 2, 3, 4, 1, 1, 7),  # (1 + 3/2) * ceil(10 / 4) = 7.5, truncated to 7
    ("doplus", 40, 3960, 1, 5, 8, 1, 1, 30),  # forget01: (1 + 5) * ceil(40 / 8)
    ("alternate", 3, 50, 1, 1, 4, 1, 1, 2),  # (1 + 1) * ceil(3 / 4) = 2
])
def test_authors_epoch_steps_by_hand(scheme, forget, retain, f_f, f_r, batch, accum, processes, epoch):
    assert authors_epoch_steps(scheme, forget, retain, f_f, f_r, batch * accum * processes) == epoch


def test_a_one_step_epoch_has_no_warmup():
    assert authors_warmup(1) == 0 and authors_warmup(2) == 2 and authors_warmup(60) == 60
    assert authors_epoch_steps("joint", 3, 10, 1, 5, 4) == 1


def test_warmup_default_counts_grad_accum_in_the_effective_batch(tiny_llama, authors_dir, tmp_path):
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", authors_dir / "forget01.json", "--retain",
                   "tofu-authors", "--loss", "IDK+GD", "--scheme", "doplus", "--steps", 9, "--batch-size", 1,
                   "--grad-accum", 2, "--max-length", 32, "--show-samples", 0, "--out", out, "--lr", 0) == 0
    report = json.loads((out / "report.json").read_text())
    # task 1: |D_f| = 4, |D_r| = 6 + 8 = 14; ceil(4/1) = 4 <= ceil(14/5) = 3 is false:
    # (1 + 1/5) * ceil(14 / 2) = 8.4 -> 8 steps
    assert report["data"]["epoch_steps"] == 8 and report["warmup_steps"] == 8
    lrs = [json.loads(line)["lr"] for line in open(out / "metrics.jsonl")]
    assert lrs[0] == 0.0  # lr 0: the schedule's shape is checked in test_unlearn; here only that it ran


def test_evaluation_scores_the_tasks_perturbed_rows_only(tiny_llama, authors_dir, tmp_path):
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", authors_dir, "--split", "forget01",
                   "--task-id", 2, "--max-new-tokens", 2, "--out", out) == 0
    records = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]
    assert [r["question"] for r in records["forget"]] == _task_questions(authors_dir / "forget01_perturbed.json", 2)
    assert all(r["task_id"] == "2" for r in records["forget"])
    assert len(records["retain"]) == 3
    sets = json.loads((out / "eval.json").read_text())["sections"][0]["sets"]
    assert (sets[0]["task_id"], sets[0]["n"], sets[0]["file_rows"]) == (2, PER_TASK, 3 * PER_TASK)
    assert f"forget ({PER_TASK} rows scored, task 2;" in (out / "report.md").read_text()


def test_paper_protocol_caps_every_set_at_300_rows_after_picking_the_task(tofu_dir):
    task_1 = [r["question"] for r in _rows(tofu_dir / "forget10_perturbed.json") if r["task_id"] == "1"]
    retain = [r["question"] for r in _rows(tofu_dir / "retain_perturbed.json")]
    paper = load_tofu_sets("forget10", str(tofu_dir), None, None, max_rows=300)
    assert [len(s.samples) for s in paper] == [300, 300, 100, 117]
    assert [s.question for s in paper[0].samples] == task_1[:300]
    assert [s.question for s in paper[1].samples] == retain[:300]
    whole = load_tofu_sets("forget10", str(tofu_dir), None, 1)
    assert [len(s.samples) for s in whole] == [400, 400, 100, 117]
    assert [s.question for s in whole[0].samples] == task_1
    third = load_tofu_sets("forget10", str(tofu_dir), 5, 3, max_rows=300)  # --max-samples below the cap
    assert [s.question for s in third[0].samples] == [
        r["question"] for r in _rows(tofu_dir / "forget10_perturbed.json") if r["task_id"] == "3"][:5]


def test_continual_starts_each_task_from_the_previous_final_model(tiny_llama, authors_dir, tmp_path, capsys):
    common = ["--forget", authors_dir / "forget01.json", "--retain", "tofu-authors", "--loss", "IDK+GD",
              "--scheme", "doplus", "--steps", 3, "--batch-size", 2, "--max-length", 48, "--show-samples", 0,
              "--lr", 1e-3, "--eval-data-dir", authors_dir, "--eval-split", "forget01", "--eval-max-new-tokens", 2]
    out = tmp_path / "continual"
    # the dry run plans a run per task (the command's own plan of its folder) and writes nothing
    capsys.readouterr()
    assert run_cli("unlearn", "--model", tiny_llama, *common, "--task-ids", "1,2", "--continual", "--out", out,
                   "--dry-run") == 0
    assert f"out: {out}: tasks 1, 2, one run each in task-T/" in capsys.readouterr().out and not out.exists()
    assert run_cli("unlearn", "--model", tiny_llama, *common, "--task-ids", "1,2", "--continual", "--out", out) == 0
    first, second = out / "task-1", out / "task-2"
    second_report = json.loads((second / "report.json").read_text())
    assert second_report["model"] == str(first / "final")
    # its retain set lacks the first task: retain90's 6 rows + task 3 only
    assert second_report["data"]["retain_rows"] == 6 + PER_TASK
    assert second_report["data"]["task"]["unlearned"] == [1, 2]
    # task 2 unlearned on its own (not continual) keeps both other tasks in its retain set
    alone = tmp_path / "alone"
    assert run_cli("unlearn", "--model", first / "final", *common, "--task-ids", "1,2", "--continual",
                   "--task-id", 2, "--out", alone) == 2  # --task-id with --continual is refused
    assert run_cli("unlearn", "--model", first / "final", *common, "--task-id", 2, "--out", alone,
                   "--eval-every", 3) == 0
    alone_report = json.loads((alone / "report.json").read_text())
    assert alone_report["data"]["retain_rows"] == 6 + 2 * PER_TASK  # one task alone keeps both other tasks
    summary = json.loads((out / "continual.json").read_text())
    assert [row["task_id"] for row in summary["rows"]] == [1, 2]
    assert summary["running_mean"][1]["MU"] == pytest.approx(
        (summary["rows"][0]["MU"] + summary["rows"][1]["MU"]) / 2)
    assert "Running mean over the tasks unlearned so far" in (out / "report.md").read_text()
    # a second invocation with --resume skips both finished tasks and leaves their weights alone
    before = load_file(second / "final" / "model.safetensors")
    assert run_cli("unlearn", "--model", tiny_llama, *common, "--task-ids", "1,2", "--continual", "--out", out,
                   "--resume", "latest") == 0
    after = load_file(second / "final" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_continual_second_task_loads_the_first_tasks_final_weights_exactly(tiny_llama, authors_dir, tmp_path):
    """At lr 0 nothing moves, so task 2's final weights are exactly the weights it loaded: task 1's final ones."""
    out = tmp_path / "continual"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", authors_dir / "forget01.json", "--retain",
                   "tofu-authors", "--loss", "IDK+GD", "--scheme", "doplus", "--steps", 2, "--batch-size", 2,
                   "--max-length", 48, "--show-samples", 0, "--lr", 0, "--eval-data-dir", authors_dir,
                   "--eval-split", "forget01", "--eval-max-new-tokens", 2, "--task-ids", "3,1", "--continual",
                   "--out", out) == 0
    first = load_file(out / "task-3" / "final" / "model.safetensors")
    second = load_file(out / "task-1" / "final" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("extra,message", [
    (["--task-id", 7], "forget01.json: no rows with task_id 7 (its rows have task ids 1, 2, 3)"),
    (["--continual"], "--continual needs --task-ids"),
    (["--task-ids", "1,2,1", "--continual"], "--task-ids 1,2,1: task 1 is given twice"),
    (["--task-ids", "1,2"], "--task-ids unlearns tasks one after another: add --continual"),
])
def test_bad_task_options_are_one_line(tiny_llama, authors_dir, tmp_path, capsys, extra, message):
    code = run_cli("unlearn", "--model", tiny_llama, "--forget", authors_dir / "forget01.json", "--retain",
                   "tofu-authors", "--loss", "IDK+GD", "--out", tmp_path / "run", *extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_bad_task_for_evaluate_and_authors_retain_without_task_ids(tiny_llama, authors_dir, tofu_dir, tmp_path,
                                                                     capsys):
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", authors_dir, "--split", "forget01",
                   "--task-id", 9, "--out", tmp_path / "e") == 2
    assert "forget01_perturbed.json: no rows with task_id 9" in capsys.readouterr().err
    plain = tmp_path / "forget01.json"  # no task_id in its rows
    plain.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                             for r in _rows(tofu_dir / "forget01.json", 4)))
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", plain, "--retain", "tofu-authors", "--loss",
                   "IDK+GD", "--out", tmp_path / "r") == 2
    assert "its rows have no task_id" in capsys.readouterr().err


@pytest.mark.processes
def test_bench_schemes_pools_forget_tasks_and_the_statistics_match_the_runs(tiny_llama, authors_dir, tmp_path,
                                                                             monkeypatch):
    import statistics


    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the runs are subprocesses; one thread each is fastest here
    recipe = tasks_recipe(tmp_path, tiny_llama, authors_dir, steps=4)
    out = tmp_path / "bench"
    # one scheme: the pooling over tasks is per scheme, and each further scheme would only add two runs
    assert run_cli("bench", "schemes", "--recipe", recipe, "--out", out, "--schemes", "doplus", "--seeds",
                   "0", "--task-ids", "1,2") == 0
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert set(summary["runs"]) == {"doplus-t1-s0", "doplus-t2-s0"}
    (row,) = summary["rows"]
    assert row["scheme"] == "doplus"
    assert sorted(row["tasks"]) == [1, 2] and summary["over"] == "forget tasks"
    for name, task in (("doplus-t1-s0", 1), ("doplus-t2-s0", 2)):
        report = json.loads((out / "runs" / name / "report.json").read_text())
        assert report["data"]["task"]["task_id"] == task
        evaluated = json.loads((out / "runs" / name / "evals" / "step-4" / "eval.json").read_text())
        assert evaluated["sections"][0]["sets"][0]["task_id"] == task
    for key in ("MU", "UFE"):
        per_run = [json.loads((out / "runs" / name / "report.json").read_text())["evals"][-1][key]
                   for name in row["runs"]]
        assert row["metrics"][key]["mean"] == pytest.approx(statistics.mean(per_run))
        assert row["metrics"][key]["std"] == pytest.approx(statistics.stdev(per_run))
    table = (out / "SCHEMES.md").read_text()
    assert "forget tasks 1, 2 (task_id)" in table and "over forget tasks" in table and "| 2 x 1 |" in table

    # The trade-off at matched levels, from each run's curve: the task's starting model (evaluated once per task
    # into start/task-T/), then the evaluations at steps 2 and 4.
    tradeoff = summary["tradeoff"]
    curves = {}
    for name in summary["runs"]:
        task = summary["runs"][name]["task_id"]
        start = json.loads((out / "start" / f"task-{task}" / "eval.json").read_text())
        assert start["sections"][0]["sets"][0]["task_id"] == task  # the start was scored on the task's rows
        aggregates = {a["name"]: 100 * a["value"] for a in start["sections"][0]["aggregates"]}
        evals = json.loads((out / "runs" / name / "report.json").read_text())["evals"]
        assert [e["step"] for e in evals] == [2, 4]
        curves[name] = [(aggregates["UFE"], aggregates["MU"])] + [(e["UFE"], e["MU"]) for e in evals]
        assert tradeoff["curves"][name] == [pytest.approx(list(p)) for p in curves[name]]
    starts = statistics.mean(c[0][0] for c in curves.values())
    ends = statistics.median(c[-1][0] for c in curves.values())
    # the rule for the levels (the values at each level are checked by hand in test_tradeoff.py; the tiny random
    # model barely moves, so here the levels may be none, and the table says so)
    rule = [] if abs(ends - starts) < 0.1 else [round(starts + f * (ends - starts), 1) for f in (0.25, 0.5, 0.75)]
    assert tradeoff["ufe_levels"] == rule
    def walk(points, level):  # MU where UFE first reaches the level, by a plain walk along the curve
        if points[0][0] >= level:
            return points[0][1] if points[0][0] == level else None
        for (xa, ya), (xb, yb) in zip(points, points[1:]):
            if xb >= level:
                return ya + (level - xa) / (xb - xa) * (yb - ya)
        return None

    for row in tradeoff["rows"]:
        for level, entry in zip(tradeoff["ufe_levels"], row["mu_at_ufe"]):
            for name, value in zip(row["runs"], entry["values"]):
                expected = walk(curves[name], level)
                assert value == (None if expected is None else pytest.approx(expected)), (name, level)
    assert ("MU (%) at matched UFE (higher is better)" if rule else "MU (%) at matched UFE: no levels") in table
    assert "UFE (%) at matched MU" in table

    def union_area(points, x_ref):  # the union of the rectangles [x_ref, x] x [0, y], strip by strip
        xs = sorted({x_ref, *(x for x, _ in points if x > x_ref)})
        return sum((right - left) * max([max(y, 0.0) for x, y in points if x >= right], default=0.0)
                   for left, right in zip(xs, xs[1:]))

    # the whole curves: each run's dominated area, and the area compared pair by pair like the score metrics
    assert tradeoff["area_reference"][0] == pytest.approx(starts)
    for name, curve in curves.items():
        assert tradeoff["areas"][name] == pytest.approx(union_area(curve, starts), abs=1e-9), name
        assert summary["runs"][name]["values"]["envelope_area"] == tradeoff["areas"][name]
    assert tradeoff["dominance"] == []  # one scheme: no pair of rows to compare (test_tradeoff.py compares two)
    assert "Whole curves: the area of the (UFE, MU) region" in table
    assert (out / "tradeoff_curves.png").read_bytes()[:4] == b"\x89PNG"
    # a repeated task is one line, exit 2
    assert run_cli("bench", "schemes", "--recipe", recipe, "--out", out, "--schemes", "doplus", "--seeds", "0",
                   "--task-ids", "2,2") == 2


def test_generation_batches_are_twice_the_batch_size_on_the_cpu_unless_set_apart(tiny_llama, authors_dir, tmp_path,
                                                                                 monkeypatch):
    from doplus_cli.evaluation import suites

    batches, scored = [], []
    generate, score = suites.greedy_generate, suites.shared_prefix_nlls
    monkeypatch.setattr(suites, "greedy_generate", lambda *a, **k: batches.append(a[4]) or generate(*a, **k))
    monkeypatch.setattr(suites, "shared_prefix_nlls", lambda *a, **k: scored.append(a[4]) or score(*a, **k))
    args = ("evaluate", "--model", tiny_llama, "--data-dir", authors_dir, "--split", "forget01", "--max-new-tokens", 2,
            "--batch-size", 3)
    assert run_cli(*args, "--out", tmp_path / "auto") == 0
    assert batches == [6] * 4 and scored == [3] * 4  # four sets, each generated and scored once; CPU: 2 x 3
    batches.clear(), scored.clear()
    assert run_cli(*args, "--generation-batch-size", 5, "--out", tmp_path / "set") == 0
    assert batches == [5] * 4 and scored == [3] * 4  # the scoring keeps the unit


def test_the_default_generation_batch_is_the_batch_size_off_the_cpu():
    from doplus_cli.evaluation.suites import default_generation_batch

    cpu = torch.nn.Linear(2, 2)
    meta = torch.nn.Linear(2, 2, device="meta")  # any device but the CPU, without one
    assert default_generation_batch(cpu, 64) == 128 and default_generation_batch(meta, 64) == 64


def test_evaluate_logs_progress_without_a_terminal_and_reports_its_compute_floor(tiny_llama, authors_dir, tmp_path,
                                                                                  capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", authors_dir, "--split", "forget01",
                   "--max-new-tokens", 3, "--out", out) == 0
    log = capsys.readouterr().err  # pytest's capture: no terminal, as in a batch job
    for name, n in (("forget", PER_TASK), ("retain", 3), ("real_authors", 2), ("world_facts", 2)):
        assert f"generating ({name}): 0/{n}" in log and f"scoring ({name}): {n}/{n} (100%)" in log
    compute = json.loads((out / "eval.json").read_text())["compute"]
    # prompts, counted here with the tokenizer itself: the question-answer template with its BOS token
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    questions = [r["question"] for r in _rows(authors_dir / "forget01_perturbed.json") if r["task_id"] == "1"]
    for name in ("retain_perturbed.json", "real_authors_perturbed.json", "world_facts_perturbed.json"):
        questions += [r["question"] for r in _rows(authors_dir / name)]
    prompt_lengths = [len(tokenizer(f"Question: {q}\nAnswer:")["input_ids"]) for q in questions]
    assert compute["tokens"]["prompt"] == sum(prompt_lengths)
    assert len(questions) <= compute["tokens"]["generated"] <= 3 * len(questions)
    # teacher-forced: every prompt once, plus at least the longest answer's tokens of each question
    assert compute["tokens"]["teacher_forced"] > sum(prompt_lengths)
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama).parameters())
    assert compute["parameters"] == parameters
    total = sum(compute["tokens"][k] for k in ("prompt", "generated", "teacher_forced"))
    # measured at the start and at the end, each kernel's faster rate kept
    start, end = compute["kernel_gflops_measured"]
    assert set(start) == set(end) == set(compute["kernel_gflops"]) and "matmul" in start
    assert all(compute["kernel_gflops"][name] == max(start[name], end[name]) for name in start)
    # the floor is over the fastest kernel measured (oneDNN's packed linear runs the layers on most CPUs), so
    # the wall time cannot beat it; torch's matmul gives the second ratio
    fastest = max(compute["kernel_gflops"].values())
    assert compute["kernel_gflops"][compute["floor_kernel"]] == fastest
    assert compute["floor_s"] == pytest.approx(2 * parameters * total / (fastest * 1e9))
    assert compute["ratio"] == pytest.approx(compute["wall_s"] / compute["floor_s"])
    assert compute["matmul_gflops"] == compute["kernel_gflops"]["matmul"]
    assert compute["matmul_floor_s"] == pytest.approx(2 * parameters * total / (compute["matmul_gflops"] * 1e9))
    assert compute["matmul_ratio"] == pytest.approx(compute["wall_s"] / compute["matmul_floor_s"])
    assert compute["ratio"] >= compute["matmul_ratio"]
    linears = sum(type(m) is torch.nn.Linear for m in AutoModelForCausalLM.from_pretrained(tiny_llama).modules())
    report = (out / "report.md").read_text()
    assert linears > 0 and "Compute floor:" in report
    # the command's peak memory: the evaluation ran in this process, whose peak RSS can only have grown since
    if not torch.cuda.is_available():
        import resource

        peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        assert compute["peak_memory_kind"] == "process_peak_rss"
        assert 0 < compute["peak_memory_gb"] <= peak_now
        assert f"Peak memory {compute['peak_memory_gb']:.2f} GB (the process's peak RSS)." in report
    if torch.cuda.is_available():  # the evaluation ran on the GPU: oneDNN's packed linear and the decoder's
        # compiled attention are the CPU's kernels (seen on an H100: 0 layers packed)
        assert compute["packed_linear_layers"] == 0 and compute["decode_attention_calls"] == 0
        return
    assert compute["packed_linear_layers"] == linears
    # the decoding steps ran the compiled one-token attention (decoding.py), once per layer and step
    assert compute["decode_attention_calls"] > 0 and compute["decode_attention_calls"] % 2 == 0  # 2 layers
    assert compute["eager_fallbacks"] == {}
    assert "ran the compiled decoding kernel" in report


def test_the_paper_recipe_takes_task_1_the_authors_retain_set_and_a_60_step_warmup():
    from pathlib import Path

    from doplus_cli.config import resolve_config
    from tests.tiny_model import TOFU

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tofu" / "phi-1.5" / "idk_gd.yaml"
    config = resolve_config(str(recipe), {"forget": str(TOFU / "forget10.json"), "eval_data_dir": str(TOFU)},
                            UnlearnConfig)
    plan = UnlearnCommand(config)
    plan.open()
    assert (len(plan.forget_source), len(plan.retain_source)) == (400, 3600)
    # effective batch 40 (4 x 10 on one process): (1 + 5) * ceil(400 / 40) = 60 steps, the figure
    assert plan.default_warmup(config.batch_size * config.grad_accum) == 60


def tasks_recipe(folder, model, authors_dir, steps):
    """tasks.yaml in `folder`: IDK+GD on the authors' forget01 (its tasks picked by task_id), evaluated by the TOFU
    suite at every second step."""
    import yaml

    recipe = folder / "tasks.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(model), "forget": str(authors_dir / "forget01.json"), "retain": "tofu-authors",
        "loss": "IDK+GD", "steps": steps, "lr": 1e-3, "batch_size": 2, "max_length": 48, "show_samples": 0,
        "eval_every": 2, "eval_suite": "tofu", "eval_split": "forget01", "eval_data_dir": str(authors_dir),
        "eval_max_new_tokens": 2}))
    return recipe


def tuned_lr(scheme: str) -> float:
    """The learning rate at which the stub's objective (below) is best for `scheme`: each scheme its own."""
    return {"alternate": 1e-3, "doplus": 3e-3}[scheme]


def test_bench_schemes_tune_gives_each_scheme_its_study_and_runs_the_grid_at_its_best_values(
        tiny_llama, authors_dir, tmp_path, monkeypatch):
    """--tune: a study per scheme on forget task 1 (its trials a stub, scored -(log10 lr - log10 best)^2 with each
    scheme's own best), then the grid on task 2 with each scheme at its study's best lr, named in SCHEMES.md."""
    import math

    import yaml

    import doplus_cli.tune as tune_module
    from doplus_cli.tune.trials import Outcome

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = []

    def trial(tune, trial, values, signals, log):
        seen.append((values["scheme"], values["task_id"]))
        score = -((math.log10(values["lr"]) - math.log10(tuned_lr(values["scheme"]))) ** 2)
        return Outcome({"OVR": score, "MU": 1.0}, 0.0, tune.steps, {})

    monkeypatch.setattr(tune_module, "run_trial", trial)
    recipe = tasks_recipe(tmp_path, tiny_llama, authors_dir, steps=2)
    out = tmp_path / "bench"
    assert run_cli("bench", "schemes", "--recipe", recipe, "--out", out, "--schemes", "alternate,doplus", "--seeds",
                   "0", "--task-ids", "2", "--tune", "lr=log:1e-5:1e-1", "--tune-trials", "16",
                   "--tune-objective", "OVR", "--tune-task", "1") == 0
    assert sorted(set(seen)) == [("alternate", 1), ("doplus", 1)] and len(seen) == 32
    summary = json.loads((out / "SCHEMES.json").read_text())
    for scheme in ("alternate", "doplus"):
        best = json.loads((out / "tune" / scheme / "TUNE.json").read_text())["best"]["params"]
        assert summary["tuned"]["values"][scheme] == best
        assert abs(math.log10(best["lr"]) - math.log10(tuned_lr(scheme))) < 0.5
        run = yaml.safe_load((out / "recipes" / f"{scheme}-t2-s0.yaml").read_text())
        assert run["lr"] == best["lr"] and run["task_id"] == 2
        report = json.loads((out / "runs" / f"{scheme}-t2-s0" / "report.json").read_text())
        assert report["config"]["lr"] == best["lr"] and report["data"]["task"]["task_id"] == 2
    assert "- Tuned: doplus tune gave each scheme 16 trials" in (out / "SCHEMES.md").read_text()


@pytest.mark.parametrize("extra, words", [
    (["--tune", "lr=log:1e-5:1e-1", "--tune-objective", "OVR", "--task-ids", "2"], "give --tune-task T"),
    (["--tune", "lr=log:1e-5:1e-1", "--tune-objective", "OVR", "--task-ids", "1,2", "--tune-task", "1"],
     "--tune-task 1 is also in --task-ids"),
    (["--tune", "lr=log:1e-5:1e-1", "--tune-task", "1", "--task-ids", "2"], "--tune needs --tune-objective"),
    (["--tune", "lr=log:1e-5:1e-1", "--tune-objective", "OVR", "--tune-task", "1", "--task-ids", "2",
      "--list-runs"], "--tune and --list-runs"),
    (["--tune-objective", "OVR"], "go with --tune"),
])
def test_bench_schemes_tune_bad_input_is_one_line(tiny_llama, authors_dir, tmp_path, capsys, extra, words):

    recipe = tasks_recipe(tmp_path, tiny_llama, authors_dir, steps=2)
    out = tmp_path / "bench"
    assert run_cli("bench", "schemes", "--recipe", recipe, "--out", out, "--schemes", "alternate,doplus",
                   *extra) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert not out.exists()
