"""Mini-MUSE (recipes/data/make_muse_mini.py, recipes/bench/muse_mini.yaml): the generator writes the shipped files
and writes them the same way every time, the MUSE suite's loader reads them, and `bench schemes` compares MUSE and
WMDP recipes by those suites' metrics (planned in-process, nothing trained)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from doplus_cli.bench.schemes.planning import plan_bench
from doplus_cli.errors import UserError
from doplus_cli.evaluation.muse import load_muse_sets

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = RECIPES / "data" / "muse_mini"


def generator():
    spec = importlib.util.spec_from_file_location("make_muse_mini", RECIPES / "data" / "make_muse_mini.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_generator_writes_the_shipped_files_the_same_way_every_time(tmp_path):
    make = generator()
    written = make.write(tmp_path / "a")
    make.write(tmp_path / "b")
    names = sorted(p.relative_to(tmp_path / "a").as_posix() for p in written)
    assert names == sorted(p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.jsonl"))
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() == \
            (SHIPPED / name).read_bytes(), name
    assert make.build(seed=1) != make.build(seed=0)  # the seed is what fixes the texts


def test_the_suite_loader_reads_every_set_and_the_sets_hang_together():
    sets = load_muse_sets(str(SHIPPED), None)
    expected = {"verbmem": 12, "forget_qa": 12, "forget_qa_icl": 2, "retain_qa": 12, "retain_qa_icl": 2,
                "privleak_forget": 12, "privleak_holdout": 12}
    assert {name: len(sets[name][0]) for name in expected} == expected
    forget = [r["text"] for r in rows(SHIPPED / "raw" / "forget.jsonl")]
    retain = [r["text"] for r in rows(SHIPPED / "raw" / "retain1.jsonl")]
    holdout = [r["text"] for r in rows(SHIPPED / "raw" / "holdout.jsonl")]
    # VerbMem: prompt + continuation is the forget article the model is taught and then made to forget
    assert [r["prompt"] + r["gt"] for r in rows(SHIPPED / "verbmem" / "forget.jsonl")] == forget
    assert [r["text"] for r in rows(SHIPPED / "privleak" / "forget.jsonl")] == forget
    assert [r["text"] for r in rows(SHIPPED / "privleak" / "holdout.jsonl")] == holdout
    # KnowMem: the i-th question asks about the i-th article's town, and its answer is stated there
    for qa, texts in (("forget_qa", forget), ("retain_qa", retain)):
        for pair, text in zip(rows(SHIPPED / "knowmem" / f"{qa}.jsonl"), texts):
            town = text.split(" to build ")[0]
            assert town in pair["question"] and pair["answer"] in text
    # members and non-members never share an article
    towns = [{t.split(" to build ")[0] for t in texts} for texts in (forget, retain, holdout)]
    assert not (towns[0] & towns[1] or towns[0] & towns[2] or towns[1] & towns[2])
    # MUSE's shapes: scal/forget_k holds the first k sust requests, sust/forget_1 and scal/forget_1 are raw/forget
    sust = [rows(SHIPPED / "sust" / f"forget_{k}.jsonl") for k in range(1, 5)]
    assert [r["text"] for r in sust[0]] == forget
    for k in range(1, 5):
        assert rows(SHIPPED / "scal" / f"forget_{k}.jsonl") == [r for part in sust[:k] for r in part]


def test_bench_planning_scores_a_muse_recipe_by_the_muse_suite(tmp_path):
    bench = plan_bench(str(RECIPES / "bench" / "muse_mini.yaml"), "joint,doplus", "0", str(tmp_path / "out"), [],
                       None, False)
    kind, run = bench.adapter, bench.runs[0]
    keys = [m.key for m in kind.metric_list(run.config)]
    assert keys == ["forget_verbmem_ROUGE", "forget_knowmem_ROUGE", "retain_knowmem_ROUGE", "muse_privleak"]
    command = kind.evaluate_command(run.config, run.folder)
    assert command[command.index("--suite") + 1] == "muse" and command[command.index("--muse-corpus") + 1] == "news"
    assert Path(command[command.index("--muse-data") + 1]).resolve() == SHIPPED.resolve()
    axes = kind.tradeoff_axes(set(keys))
    assert (axes.x, axes.y, axes.y_complement) == ("retain_knowmem_ROUGE", "forget_verbmem_ROUGE", True)
    assert kind.curve_names(run.config) == ()
    # a finished run's scores are the suite's SUMMARY.json values under those keys
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    summary = {"forget_verbmem_ROUGE": 0.125, "forget_knowmem_ROUGE": 0.25, "retain_knowmem_ROUGE": 0.5,
               "muse_privleak": -37.5, "MU": 99.0}
    (evaluation / "SUMMARY.json").write_text(json.dumps(summary))
    (evaluation / "eval.json").write_text(json.dumps({"sections": [{"suite": "muse"}]}))
    values, notes = kind.scores({"config": {"eval_suite": "muse"}}, evaluation)
    assert values == {key: summary[key] for key in keys} and notes == {}
    with pytest.raises(UserError, match="eval_split: news or books"):
        plan_bench(str(RECIPES / "bench" / "muse_mini.yaml"), "doplus", "0", str(tmp_path / "other"),
                   ["eval_split=forget10"], None, False)


def test_bench_planning_scores_a_wmdp_recipe_by_the_wmdp_suite(tmp_path):
    bench = plan_bench(str(RECIPES / "wmdp" / "rmu_zephyr_doplus.yaml"), "alternate,doplus", "42",
                       str(tmp_path / "out"), ["eval_max_samples=50"], None, False)
    kind, run = bench.adapter, bench.runs[0]
    keys = [m.key for m in kind.metric_list(run.config)]
    assert keys == ["wmdp_bio/acc", "wmdp_cyber/acc", "wmdp_chem/acc", "mmlu/acc"]
    assert [m.higher_is_better for m in kind.metric_list(run.config)] == [False, False, False, True]
    command = kind.evaluate_command(run.config, run.folder)
    assert command[command.index("--suite") + 1] == "wmdp" and command[command.index("--limit") + 1] == "50"
    axes = kind.tradeoff_axes(set(keys))
    assert (axes.x, axes.y, axes.y_complement) == ("mmlu/acc", "wmdp_bio/acc", True)
