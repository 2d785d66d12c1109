"""The memory plan (`--dry-run`) against the measured peak of short real runs of the embedded model on the CPU.

    python tests/memory_measure.py [SCHEME ...]     # every scheme of config.SCHEMES by default
    python tests/memory_measure.py --sizing         # docs/memory.md's table for 1B, 7B and 8B Llamas

Each scheme runs 3 steps of `doplus unlearn` (NPO+GD on TOFU's forget10 and retain90, batch 4, 64 tokens, so that
every batch fills the plan's sequence length and both objectives step) in a process of its own. That process
imports what a run imports first, reads its resident set (VmRSS), runs the command, and reports its peak resident
set (ru_maxrss) less that baseline: what the run added to the process, which is what the plan counts, plus what it
does not (the tokenizer and data, torch.compile's work for DualOptim+'s fused kernels, the optimizer step's
temporaries). glibc's allocator is told to return freed blocks (`ALLOCATOR_ENV`). Not part of the suite: it takes
minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DOPLUS_SHARED", ROOT.parent / "shared"))
TOFU = SHARED / "data" / "tofu"
FLAGS = ["--forget", str(TOFU / "forget10.json"), "--retain", str(TOFU / "retain90.json"), "--loss", "NPO+GD",
         "--steps", "3", "--batch-size", "4", "--max-length", "64", "--show-samples", "0", "--forget-freq", "1",
         "--retain-freq", "2", "--warmup-steps", "1", "--precision", "fp32", "--dtype", "float32"]

# glibc's malloc serves blocks under its dynamic mmap threshold (it grows to 32 MiB as large blocks are freed) from
# its heap, and keeps them there once freed: the peak resident set would count tensors long gone. A fixed threshold
# of 128 KiB gives every tensor of any size its own mapping, returned to the system when the tensor is freed.
ALLOCATOR_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}

CHILD = r"""
import json, resource, sys
import torch, transformers, accelerate, bitsandbytes  # what a run imports, before the baseline
from transformers.models.llama import modeling_llama
from doplus_cli import cli
from doplus_cli.engine import loop

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

baseline = rss()
try:
    cli.main(sys.argv[1:])
except SystemExit as stop:
    if stop.code:
        raise
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"baseline": baseline, "peak": peak}))
"""


def scheme_flags(name: str) -> list[str]:
    from doplus_cli.config import SCHEMES

    flags = []
    for key, value in SCHEMES[name].values.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def planned(flags: list[str]) -> int:
    from doplus_cli.commands import command_for
    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config
    from doplus_cli.engine.memory_plan import build_plan, model_plan

    values = {}
    for flag, value in zip(flags[::2], flags[1::2]):
        key = flag[2:].replace("-", "_")
        values[key] = int(value) if value.isdigit() else value
    config = resolve_config(None, values, UnlearnConfig)
    run = command_for(config)
    return build_plan(config, model_plan(config, run), run, cuda=False).total(1, False)


def main(names: list[str]) -> None:
    from doplus_cli.config import SCHEMES

    names = names or [n for n in SCHEMES if "paper" not in n and "delta" not in n]
    print("| scheme | plan (GiB) | measured (GiB) | measured / plan |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        flags = FLAGS + scheme_flags(name)
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, "-c", CHILD, "unlearn", *flags, "--out", out + "/run"],
                                  capture_output=True, text=True, timeout=1800, cwd=ROOT, env=ALLOCATOR_ENV)
        if done.returncode:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1:]} |")
            continue
        facts = json.loads(done.stdout.strip().splitlines()[-1])
        measured = facts["peak"] - facts["baseline"]
        plan = planned(flags)
        print(f"| {name} | {plan / 2**30:.3f} | {measured / 2**30:.3f} | {measured / plan:.2f} |", flush=True)


SIZING_MODELS = {"Llama-3.2-1B": "llama-3.2-1b", "Llama-2-7B": "llama-2-7b", "Llama-3-8B": "llama-3-8b"}
SIZING_SCHEMES = {"Joint (AdamW)": {"scheme": "joint"}, "DO": {"scheme": "dualoptim"}, "DO+": {"scheme": "doplus"},
                  "DO+ 8bit": {"scheme": "doplus", "state_bits": 8},
                  "DO+ LoRA r16": {"scheme": "doplus", "lora_rank": 16}}


def sizing() -> None:
    """GiB per process of `doplus unlearn` (NPO+GD, bf16-mixed on a GPU, batch 4 x 512 tokens, gradient
    checkpointing) for each model and scheme: 1 process, and 8 processes under DDP and under FSDP."""
    from doplus_cli.commands import command_for
    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config
    from doplus_cli.engine.memory_plan import build_plan, model_plan

    print("| model | scheme | trainable | 1 process | DDP x 8 | FSDP x 8 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, folder in SIZING_MODELS.items():
        for scheme, values in SIZING_SCHEMES.items():
            config = resolve_config(None, {
                "model": str(ROOT / "tests" / "data" / "model-configs" / folder), "forget": str(TOFU / "forget10.json"),
                "retain": str(TOFU / "retain90.json"), "loss": "NPO+GD", "batch_size": 4, "max_length": 512,
                "gradient_checkpointing": True, **values}, UnlearnConfig)
            run = command_for(config)
            plan = build_plan(config, model_plan(config, run), run, cuda=True)
            gib = [plan.total(1, False), plan.total(8, False), plan.total(8, True)]
            print(f"| {label} | {scheme} | {plan.model.trainable / 1e9:.3g} B | "
                  + " | ".join(f"{b / 2**30:.1f}" for b in gib) + " |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--sizing"]:
        sizing()
    else:
        main(sys.argv[1:])
