"""Greedy answers through doplus's row-dropping decoder against transformers' `generate`, on the same model,
questions and batches; writes the timings and whether every answer is the same token for token.

    python docs/data/decoding_vs_generate.py TOFU_FOLDER OUT.json [--questions 128] [--batch-size 32]
        [--max-new-tokens 64 | --max-total-tokens 200] [--repeats 3]

The model is the embedded SmolLM2-135M-Instruct (float32 on the CPU, bfloat16 on a GPU), prompted with its chat
template; the questions are the first N of TOFU's forget10 file. `--max-new-tokens` is the doplus protocol's
budget, `--max-total-tokens` the paper protocol's (each answer up to that many tokens less its prompt). Each repeat
runs both paths, alternating which goes first; `doplus_cli.generation.greedy_generate` is called both times, once
with its own decoder and once with `_drops_rows` answering False, which sends every batch to `model.generate`. Run
it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from doplus_cli import __version__, generation
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.models import load_model_and_tokenizer


def timed(model, formatter, questions, max_new_tokens, batch_size, dropping: bool, max_total_tokens=None):
    original = generation._drops_rows
    if not dropping:
        generation._drops_rows = lambda model: False
    try:
        start = time.perf_counter()
        _, tokens = generation.greedy_generate(model, formatter, questions, max_new_tokens, batch_size=batch_size,
                                               max_total_tokens=max_total_tokens)
        return time.perf_counter() - start, tokens
    finally:
        generation._drops_rows = original


def cpu_name() -> str:
    """The processor's model name (Linux), else what the platform module says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tofu")
    parser.add_argument("out")
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.tofu, "forget10.json").read_text().splitlines() if line.strip()]
    questions = [row["question"] for row in rows[:args.questions]]
    model, tokenizer, _ = load_model_and_tokenizer(None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    formatter = PromptFormatter(tokenizer, max_length=256)
    timed(model, formatter, questions[:args.batch_size], 8, args.batch_size, True)  # warm both paths up
    timed(model, formatter, questions[:args.batch_size], 8, args.batch_size, False)
    runs, same = [], True
    for repeat in range(args.repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        found = {}
        for dropping in order:
            seconds, tokens = timed(model, formatter, questions, args.max_new_tokens, args.batch_size, dropping,
                                    args.max_total_tokens)
            found[dropping] = tokens
            runs.append({"repeat": repeat, "path": "decode_dropping" if dropping else "generate",
                         "seconds": round(seconds, 3)})
            print(runs[-1], flush=True)
        same = same and found[True] == found[False]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "command": "python docs/data/decoding_vs_generate.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("tofu", "out") and v is not None),
        "doplus": __version__, "commit": commit, "machine": cpu_name(),
        "cpus": torch.get_num_threads(), "device": str(device), "torch": torch.__version__,
        "answers_identical": same, "generated_tokens": sum(len(row) for row in found[True]), "runs": runs,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
