"""`doplus bench optimizer`: size parsing, option checks, the synthetic parameter set and the JSON it prints."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from rich.console import Console

from doplus_cli.bench import optimizer as bench
from doplus_cli.cli import main
from doplus_cli.errors import UserError

FAST = ["--steps", "5", "--warmup", "1"]


def run_cli(argv: list[str]) -> None:
    """`main` as the console script runs it: success may end in SystemExit(0) (click's standalone mode)."""
    try:
        main(argv)
    except SystemExit as exit_info:
        assert exit_info.code in (0, None), exit_info.code


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("50M", 50_000_000),
        ("1.5G", 1_500_000_000),
        ("200k", 200_000),
        ("123456", 123_456),
        ("2K", 2_000),
        ("0.5k", 500),
        (" 7m ", 7_000_000),
        ("1B", 1_000_000_000),  # as model sizes are written ("a 1B model"), and as GPU.md asks for it
        ("0.5b", 500_000_000),
    ],
)
def test_parse_size(text, expected):
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "5X", "50MB", "1.5", "0", "0k", "-5", "1e6", "1.2.3M", "0.0001k"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError, match="--params"):
        bench.parse_size(text)


def test_from_cli_validates_options():
    config = bench.BenchConfig.from_cli(params="200k", dtype="bfloat16", device="cpu", only="doplus, adamw")
    assert config.params == 200_000 and config.dtype is torch.bfloat16 and config.device == "cpu"
    assert config.only == ("adamw", "doplus")  # the table's order, whatever the order asked for
    with pytest.raises(UserError, match="--dtype.*float32, bfloat16, float16"):
        bench.BenchConfig.from_cli(params="1M", dtype="int8")
    with pytest.raises(UserError, match="--only: unknown row\\(s\\) nope; choose from adamw"):
        bench.BenchConfig.from_cli(params="1M", only="adamw,nope")
    with pytest.raises(UserError, match="--device"):
        bench.BenchConfig.from_cli(params="1M", device="tpu")
    with pytest.raises(UserError, match="--steps"):
        bench.BenchConfig.from_cli(params="1M", steps=3)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--device: 'cuda'.*not available"):
            bench.BenchConfig.from_cli(params="1M", device="cuda")


@pytest.mark.parametrize("count", [1, 10, 1_000, 53_311, 53_312, 300_000, 50_000_000, 1_500_000_000])
def test_synthetic_shapes_are_exact_and_transformer_like(count):
    shapes, layout = bench.synthetic_shapes(count)
    assert sum(math.prod(shape) for shape in shapes) == count
    assert all(len(shape) in (1, 2) and min(shape) >= 1 for shape in shapes)
    if count >= 53_312:  # at least one whole layer: 7 matrices and a norm vector per layer
        d = layout["hidden"]
        assert d % 64 == 0 and layout["layers"] >= 1
        assert shapes[:8].count((d, d)) == 4 and shapes[7] == (d,)
        assert sum(len(shape) == 1 for shape in shapes) >= layout["layers"]


def _fp32_state_bytes(numel: int) -> int:
    return 4 * numel


def _8bit_state_bytes(numel: int) -> int:
    """bitsandbytes' layout: one uint8 code per element and one fp32 absmax per 256-element block."""
    if numel < 4096:  # too small for 8-bit: stays float32
        return _fp32_state_bytes(numel)
    return numel + 4 * -(-numel // 256)


# Scripted step times (seconds) per row: one warm-up step, then the five timed steps (medians 3 ms, 4.5 ms,
# 6 ms) and a copy bandwidth of 20 GB/s, so that every derived number has a value known here.
TIMES = {
    "adamw": [0.5, 0.004, 0.002, 0.003, 0.010, 0.001],
    "adamw-fused": [0.5, 0.004, 0.002, 0.003, 0.010, 0.001],
    "doplus": [0.9, 0.006, 0.0045, 0.020, 0.0045, 0.004],
    "doplus-8bit": [1.2, 0.006, 0.007, 0.005, 0.030, 0.004],
    "dualoptim": [0.7, 0.006, 0.007, 0.005, 0.030, 0.004],
    "doplus-muon": [0.7, 0.006, 0.0045, 0.020, 0.0045, 0.004],
}
MEDIAN = {"adamw": 0.003, "adamw-fused": 0.003, "doplus": 0.0045, "doplus-8bit": 0.006, "dualoptim": 0.006,
          "doplus-muon": 0.0045}
COPY_GBPS = 20.0


@pytest.fixture
def scripted_clock(monkeypatch):
    """Each row's steps still run (states are allocated and counted), but report the times in TIMES."""
    real_step = bench._step
    calls: dict[str, int] = {}

    def step(optimizer, row, index, device):
        real_step(optimizer, row, index, device)
        calls[row.name] = calls.get(row.name, 0) + 1
        return TIMES[row.name][index]

    monkeypatch.setattr(bench, "_step", step)
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda numel, device, repeats=15: COPY_GBPS)
    return calls


def test_cli_json_end_to_end(capsys, scripted_clock):
    run_cli(["bench", "optimizer", "--params", "300k", *FAST, "--json", "--only", "adamw,doplus,doplus-8bit"])
    out = capsys.readouterr().out
    result = json.loads(out)
    n = result["params"]
    assert n == 300_000 and result["dtype"] == "float32" and result["steps"] == 5 and result["warmup"] == 1
    assert result["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert result["copy_gbps"] == COPY_GBPS and result["threads"] >= 1
    rows = {row["name"]: row for row in result["rows"]}
    assert list(rows) == ["adamw", "doplus", "doplus-8bit"]
    assert scripted_clock == {name: 6 for name in rows}  # one warm-up step and five timed ones per row
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["step_times_s"] == TIMES[name][1:] and row["first_step_s"] == TIMES[name][0]
        assert row["median_step_s"] == MEDIAN[name]
    # hand-computed from the bytes below and the scripted medians: 28·300k B / 3 ms, 44·300k B / 4.5 ms
    assert rows["adamw"]["gbps"] == pytest.approx(2.8)
    assert rows["doplus"]["gbps"] == pytest.approx(2.9333333333)
    assert rows["adamw"]["fraction_of_copy_bandwidth"] == pytest.approx(0.14)
    assert rows["doplus"]["fraction_of_copy_bandwidth"] == pytest.approx(0.1466666667)
    assert rows["adamw"]["ratio_to_adamw"] == 1.0
    assert rows["doplus"]["ratio_to_adamw"] == pytest.approx(1.5)
    assert rows["doplus-8bit"]["ratio_to_adamw"] == pytest.approx(2.0)

    shapes, _ = bench.synthetic_shapes(n)
    tensors = len(shapes)
    assert result["synthetic"]["tensors"] == tensors
    # AdamW: exp_avg, exp_avg_sq in fp32 and a float32 step counter per tensor
    assert rows["adamw"]["state_bytes"] == 2 * 4 * n + 4 * tensors
    # DualOptim+: base m, v and, after forget and retain steps, a delta m, v per objective: 6 fp32 states,
    # and three step counters (base, forget, retain) per tensor
    doplus = rows["doplus"]["state_bytes"]
    assert doplus == 6 * 4 * n + 3 * 4 * tensors
    assert rows["doplus"]["state_bytes_per_param"] == pytest.approx(24.0, abs=0.01)
    numels = [math.prod(shape) for shape in shapes]
    assert rows["doplus-8bit"]["state_bytes"] == sum(6 * _8bit_state_bytes(k) for k in numels) + 3 * 4 * tensors
    assert rows["doplus-8bit"]["state_bytes"] <= 0.30 * doplus

    # bytes a one-pass step must move, per element with fp32 parameters: AdamW 28, DualOptim+ 44 (11/7)
    assert rows["adamw"]["bytes_per_step"] == 28 * n
    assert rows["doplus"]["bytes_per_step"] == 44 * n
    assert rows["doplus-8bit"]["bytes_per_step"] == sum(12 * k + 2 * 4 * _8bit_state_bytes(k) for k in numels)
    eight_bit = sum(12 * k + 2 * 4 * _8bit_state_bytes(k) for k in numels) / 0.006 / 1e9
    assert rows["doplus-8bit"]["gbps"] == pytest.approx(eight_bit)

    screen = io.StringIO()
    bench.print_table(result, console=Console(file=screen, width=200))
    text = screen.getvalue()
    assert "copy bandwidth 20.0 GB/s" in " ".join(text.split()) and "300,000 parameters" in " ".join(text.split())
    # median, × AdamW, first step, state B/param, state, GB/s, of copy BW
    assert table_row(text, "adamw") == ["3.0 ms", "1.00×", "500.0 ms", "8.00", "2.29 MiB", "2.8", "14%"]
    assert table_row(text, "doplus") == ["4.5 ms", "1.50×", "900.0 ms", "24.00", "6.87 MiB", "2.9", "15%"]
    assert table_row(text, "doplus-8bit")[:3] == ["6.0 ms", "2.00×", "1.20 s"]


def table_row(text: str, name: str) -> list[str]:
    """The cells after the name of `name`'s row in a rich table."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("│", "|").replace("┃", "|").split("|")]
        cells = [c for c in cells if c]
        if cells and cells[0] == name:
            return cells[1:]
    raise AssertionError(f"no row {name!r} in\n{text}")


def test_cli_table_and_dual_rows(capsys, scripted_clock):
    run_cli(["bench", "optimizer", "--params", "60k", *FAST, "--only", "dualoptim,adamw-fused,doplus-muon"])
    captured = capsys.readouterr()
    caption = " ".join(captured.out.split())
    assert "copy bandwidth 20.0 GB/s" in caption and "60,000 parameters" in caption
    assert "error" not in captured.out
    # no adamw row: no ratio. 60k fp32 parameters: AdamW moves 28 B and keeps 8 B (+ step counters) of
    # state per parameter; DualOptim keeps two AdamW states and moves one per step
    adamw_fused = table_row(captured.out, "adamw-fused")
    assert adamw_fused[:3] == ["3.0 ms", "–", "500.0 ms"] and adamw_fused[5:] == ["0.6", "2.8%"]  # 1.68 MB / 3 ms
    dualoptim = table_row(captured.out, "dualoptim")
    assert dualoptim[:3] == ["6.0 ms", "–", "700.0 ms"] and dualoptim[5:] == ["0.3", "1.4%"]  # 1.68 MB / 6 ms
    assert float(dualoptim[3]) == pytest.approx(2 * float(adamw_fused[3]), abs=0.011)
    assert table_row(captured.out, "doplus-muon")[0] == "4.5 ms"


def test_dual_rows_hold_both_objectives(capsys):
    run_cli(["bench", "optimizer", "--params", "60k", *FAST, "--json", "--only", "dualoptim,doplus-muon"])
    result = json.loads(capsys.readouterr().out)
    n, tensors = result["params"], result["synthetic"]["tensors"]
    rows = {row["name"]: row for row in result["rows"]}
    assert "ratio_to_adamw" in rows["dualoptim"] and rows["dualoptim"]["ratio_to_adamw"] is None  # no adamw row
    # DualOptim: a full AdamW state (m, v, step) per objective
    assert rows["dualoptim"]["state_bytes"] == 2 * (2 * 4 * n + 4 * tensors)
    # DualOptim+ with Muon: one momentum buffer in the base and per objective for 2-D weights (3 fp32 states),
    # the AdamW rule's 6 states for vectors
    shapes, _ = bench.synthetic_shapes(n)
    states = sum((3 if len(shape) == 2 else 6) * 4 * math.prod(shape) for shape in shapes)
    assert rows["doplus-muon"]["state_bytes"] == states + 3 * 4 * tensors


def test_a_failing_row_is_reported_not_fatal(monkeypatch):
    def broken(params):
        raise RuntimeError("no kernel [for this]")

    rows = (bench.ROWS[0], bench.Row("broken", "always fails", broken, False))
    monkeypatch.setattr(bench, "ROWS", rows)
    config = bench.BenchConfig(params=20_000, dtype=torch.float32, device="cpu", steps=5, warmup=1)
    result = bench.run_optimizer_bench(config, progress=False)
    assert [row["name"] for row in result["rows"]] == ["adamw", "broken"]
    assert result["rows"][1]["error"] == "RuntimeError: no kernel [for this]"
    assert result["rows"][0]["ratio_to_adamw"] == 1.0
    screen = io.StringIO()
    bench.print_table(result, console=Console(file=screen, width=200))
    assert "no kernel [for this]" in screen.getvalue()


def test_unknown_row_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "optimizer", "--params", "300k", "--json", "--only", "adamw,nope"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--only" in lines[0] and "nope" in lines[0] and "doplus-8bit" in lines[0]


def test_bad_size_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "optimizer", "--params", "fifty", "--json"])
    assert exit_info.value.code == 2
    assert "--params" in capsys.readouterr().err
