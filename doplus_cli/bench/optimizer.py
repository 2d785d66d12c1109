"""`doplus bench optimizer`: step time, state memory and bandwidth of DualOptim+ against torch AdamW.

Every row steps the same synthetic parameters (a fresh copy each) with the same fixed gradients:

* step time: `warmup` untimed steps (the first one, which allocates the states and compiles the fused
  kernels, is reported on its own as ``first_step_s``), then the median of `steps` timed steps. On CUDA the
  device is synchronised around every step. ``ratio_to_adamw`` divides by torch AdamW's median from the
  same run. The DualOptim and DualOptim+ rows alternate ``step(objective="forget")`` and
  ``step(objective="retain")``, so both delta states exist and both are timed.
* state bytes: every tensor in the optimizer's state (nested dicts included; a tensor shared by several
  parameters, such as bitsandbytes' quantisation map, is counted once), step counters included.
* bandwidth: an optimizer step is memory-bound, so the step is compared with the cost of a plain copy.
  Copy bandwidth is measured once per run as the median time of ``dst.copy_(src)`` over float32 tensors
  of N elements (N = the parameter count), counting 2·4·N bytes (read + write). A row's achieved GB/s is
  the traffic a single-pass implementation cannot avoid, divided by its median step time::

      bytes_per_step = Σ_p  numel_p · (2·b_param + b_grad)  +  2 · S_p

  with b_param, b_grad the element sizes of parameter and gradient (the parameter is read and written, the
  gradient read) and S_p the bytes of the state tensors one step reads and writes: everything but the
  per-objective states, plus one objective's state. Per element with float32 parameters this is

      AdamW, DualOptim           3·4 + 2·(2·4)  = 28 B     (θ, g, m, v read; θ, m, v written)
      DualOptim+ (AdamW rule)    3·4 + 2·(4·4)  = 44 B     (m_B, v_B, m_k, v_k: 11/7 of AdamW)
      8-bit states               1 B per element plus a 4 B absmax per block of 256 instead of 4 B
      DualOptim+ Muon (2-D)      3·4 + 2·(2·4)  = 28 B     (m_B, m_k; Newton–Schulz is compute-bound)

  Tensors too small for 8-bit states (< 4096 elements) keep float32 states, as in bitsandbytes; S_p is
  read off the states actually allocated, so that is accounted for. ``fraction_of_copy_bandwidth`` =
  achieved GB/s ÷ copy GB/s: 1.0 means the step moves its bytes as fast as a copy moves its own. On CPUs
  a copy's stores first read the destination line (write-allocate), so a copy really moves ~3·4·N bytes
  while 2·4·N are counted; an in-place update reads every array it writes and pays no such extra read,
  so a fused optimizer can reach ~1.5 there. The copy is measured once, after a few untimed torch AdamW
  steps that warm the process up (allocator, page faults), so the first row is not the one paying for it.
"""

from __future__ import annotations

import gc
import math
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import torch
from torch import Tensor

from doplus_cli import optim
from doplus_cli.config import list_value
from doplus_cli.engine.memory_plan import bytes_text
from doplus_cli.errors import UserError
from doplus_cli.optim import multi_tensor, quant

LR = 1e-5
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
OBJECTIVES = ("forget", "retain")
PARAM_INIT_STD = 0.02
GRAD_SCALE = 1e-3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# B as in "a 1B model" (GPU.md asks for `--params 1B`, and model cards count parameters that way)
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKmMgGbB]?)\s*$")
MIN_STEPS = 5


# -- configuration ---------------------------------------------------------------------------------------


def parse_size(text: str, option: str = "--params") -> int:
    """'50M' → 50_000_000, '1.5G' and '1.5B' → 1_500_000_000, '200k' → 200_000, '123456' → 123456.

    Suffixes k, M, G or B (either case) are 1e3, 1e6, 1e9, 1e9; the result must be a whole number >= 1.
    """
    match = _SIZE_RE.match(str(text))
    hint = "use a whole number with an optional k, M, G or B suffix, e.g. 50M, 1.5G, 1B, 200k, 123456"
    if match is None:
        raise UserError(f"{option}: cannot read {text!r} as a parameter count; {hint}")
    try:
        value = Decimal(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    except InvalidOperation as error:  # pragma: no cover - the regex admits only decimal numbers
        raise UserError(f"{option}: cannot read {text!r} as a parameter count; {hint}") from error
    if value != value.to_integral_value():
        raise UserError(f"{option}: {text!r} is not a whole number of parameters; {hint}")
    if value < 1:
        raise UserError(f"{option}: {text!r} must be at least 1 parameter; {hint}")
    return int(value)


@dataclass(frozen=True)
class Row:
    """One optimizer under test: its name for --only, what it is, how to build it, and how to step it."""

    name: str
    description: str
    build: Callable[[list[Tensor]], torch.optim.Optimizer]
    dual: bool  # step(objective=...) alternating forget/retain


def _torch_adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _torch_adamw_fused(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)


def _dual(name: str, **options: Any) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """Builder for `doplus_cli.optim.<name>` (DualOptim or DualOptimPlus) with the bench's shared settings."""

    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        return getattr(optim, name)(
            params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, objectives=OBJECTIVES, **options
        )

    return build


def _bnb_adamw8bit(params: list[Tensor]) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


ROWS: tuple[Row, ...] = (
    Row("adamw", "torch.optim.AdamW, default implementation (the ratio baseline)", _torch_adamw, False),
    Row("adamw-fused", "torch.optim.AdamW(fused=True)", _torch_adamw_fused, False),
    Row("dualoptim", "DualOptim: one AdamW per objective, 32-bit states", _dual("DualOptim", state_bits=32), True),
    Row("dualoptim-8bit", "DualOptim: one AdamW per objective, 8-bit states", _dual("DualOptim", state_bits=8), True),
    Row("doplus", "DualOptim+ (AdamW rule, safeguarded), 32-bit states", _dual("DualOptimPlus", state_bits=32), True),
    Row("doplus-per-tensor", "DualOptim+ as `doplus`, one compiled kernel per tensor (no multi-tensor kernel; "
        "the same as `doplus` where that kernel does not run: the CPU)",
        _dual("DualOptimPlus", state_bits=32, multi_tensor=False), True),
    Row("doplus-paper", "DualOptim+ (the paper's exact AdamW rule), 32-bit states",
        _dual("DualOptimPlus", state_bits=32, rule="paper"), True),
    Row("doplus-8bit", "DualOptim+ (AdamW rule, safeguarded), 8-bit states", _dual("DualOptimPlus", state_bits=8),
        True),
    Row("doplus-8bit-reference", "DualOptim+ as `doplus-8bit` on the eager reference path: bitsandbytes' own "
        "dequantise and quantise around the update (the fused kernel's rounding is checked against it)",
        _dual("DualOptimPlus", state_bits=8, fused=False), True),
    Row("doplus-muon", "DualOptim+, Muon on 2-D weights, AdamW on 1-D", _dual("DualOptimPlus", inner="muon"), True),
    Row("bnb-adamw8bit", "bitsandbytes.optim.AdamW8bit (8-bit anchor)", _bnb_adamw8bit, False),
)
ROW_NAMES = tuple(row.name for row in ROWS)


@dataclass(frozen=True)
class BenchConfig:
    params: int
    dtype: torch.dtype
    device: str
    steps: int = 7
    warmup: int = 2
    only: tuple[str, ...] | None = None
    seed: int = 0

    @classmethod
    def from_cli(
        cls,
        params: str,
        dtype: str = "float32",
        device: str = "auto",
        steps: int = 7,
        warmup: int = 2,
        only: str | None = None,
        seed: int = 0,
    ) -> BenchConfig:
        """Validate the command-line values; every problem is a one-line `UserError` naming the option."""
        numel = parse_size(params, "--params")
        if dtype not in DTYPES:
            raise UserError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        device = (device or "auto").strip().lower()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cpu":
            pass
        elif re.fullmatch(r"cuda(:[0-9]+)?", device):
            if not torch.cuda.is_available():
                raise UserError(f"--device: {device!r} asked for, but CUDA is not available; use cpu or auto")
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= torch.cuda.device_count():
                count = torch.cuda.device_count()
                raise UserError(f"--device: no {device!r}; this machine has {count} CUDA device(s)")
        else:
            raise UserError(f"--device: unknown device {device!r}; choose one of auto, cpu, cuda")
        if steps < MIN_STEPS:
            raise UserError(f"--steps: need at least {MIN_STEPS} timed steps for a median, got {steps}")
        if warmup < 1:
            raise UserError(f"--warmup: need at least 1 warm-up step, got {warmup}")
        selected = None
        if only is not None:
            names = list_value(only, str, False, "--only")
            unknown = [name for name in names if name not in ROW_NAMES]
            if unknown or not names:
                what = f"unknown row(s) {', '.join(unknown)}" if unknown else "no rows named"
                raise UserError(f"--only: {what}; choose from {', '.join(ROW_NAMES)}")
            selected = tuple(name for name in ROW_NAMES if name in names)  # the table's order, adamw first
        return cls(
            params=numel,
            dtype=DTYPES[dtype],
            device=device,
            steps=steps,
            warmup=warmup,
            only=selected,
            seed=seed,
        )

    def rows(self) -> tuple[Row, ...]:
        return tuple(row for row in ROWS if self.only is None or row.name in self.only)


# -- synthetic parameters --------------------------------------------------------------------------------


def _ffn_size(hidden: int) -> int:
    return max(64, round(8 * hidden / 3 / 64) * 64)


def _layer_shapes(hidden: int) -> list[tuple[int, ...]]:
    """q, k, v, o (d×d), gate and up (f×d), down (d×f), one norm vector (d)."""
    f = _ffn_size(hidden)
    return [(hidden, hidden)] * 4 + [(f, hidden), (f, hidden), (hidden, f), (hidden,)]


def _numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def synthetic_shapes(count: int) -> tuple[list[tuple[int, ...]], dict[str, int]]:
    """Shapes of a transformer-like parameter set with exactly `count` elements, and its layout.

    Hidden size d: a multiple of 64 near (count·64/12)^(1/3), i.e. about d/64 layers of ~12·d² parameters
    (the aspect ratio of common LLMs). Whole layers first; the remainder becomes an embedding-like (r × d)
    matrix plus a short vector, so the total is exact. Below one layer of d = 64 (53,312 parameters) the
    set is one square matrix and a vector.
    """
    if count < 1:
        raise ValueError(f"need at least one parameter, got {count}")
    smallest = _numel(_layer_shapes(64))
    if count < smallest:
        side = math.isqrt(count)
        shapes: list[tuple[int, ...]] = [(side, side)]
        if count - side * side:
            shapes.append((count - side * side,))
        return shapes, {"hidden": side, "layers": 0}
    hidden = int((count * 64 / 12) ** (1 / 3)) // 64 * 64
    hidden = min(8192, max(64, hidden))
    while _numel(_layer_shapes(hidden)) > count:  # keep at least one whole layer
        hidden -= 64
    per_layer = _numel(_layer_shapes(hidden))
    layers = count // per_layer
    shapes = _layer_shapes(hidden) * layers
    rest = count - layers * per_layer
    if rest // hidden:
        shapes.append((rest // hidden, hidden))
    if rest % hidden:
        shapes.append((rest % hidden,))
    assert _numel(shapes) == count
    return shapes, {"hidden": hidden, "layers": layers}


def _random_tensors(
    shapes: Sequence[tuple[int, ...]], seed: int, scale: float, dtype: torch.dtype, device: str
) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * scale).to(device=device, dtype=dtype) for shape in shapes]


# -- measurements ----------------------------------------------------------------------------------------


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_copy_gbps(numel: int, device: str, repeats: int = 15) -> float:
    """Median bandwidth of ``dst.copy_(src)`` over float32 tensors of `numel` elements (2·4·numel bytes)."""
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 5):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        if i >= 5:  # untimed copies first: page faults, caches, clocks
            times.append(time.perf_counter() - start)
    del src, dst
    return 2 * 4 * numel / statistics.median(times) / 1e9


def _touched_state_bytes(state: dict, seen: set[int]) -> int:
    """State bytes one step reads (and writes): the tensors at this level plus one nested dict's worth.

    Nested dicts are per-objective states (DualOptim+ ``delta[k]``, DualOptim ``state[p][k]``); a step uses
    one of them. Scalars (step counters) and tensors already seen (shared tables) are left out.
    """
    own = 0
    nested = []
    for value in state.values():
        if isinstance(value, Tensor):
            if value.ndim > 0 and id(value) not in seen:
                own += value.numel() * value.element_size()
            seen.add(id(value))
        elif isinstance(value, dict):
            nested.append(_touched_state_bytes(value, seen))
    return own + max(nested, default=0)


def bytes_per_step(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> int:
    """Bytes a single-pass implementation must read and write in one step (see the module docstring)."""
    total = 0
    seen: set[int] = set()
    states = optimizer.state
    for param in params:
        grad_size = param.grad.element_size() if param.grad is not None else param.element_size()
        total += param.numel() * (2 * param.element_size() + grad_size)
        state = states.get(param) if hasattr(states, "get") else None
        if isinstance(state, dict):
            total += 2 * _touched_state_bytes(state, seen)
    return total


def _step(optimizer: torch.optim.Optimizer, row: Row, index: int, device: str) -> float:
    _synchronize(device)
    start = time.perf_counter()
    if row.dual:
        optimizer.step(objective=OBJECTIVES[index % len(OBJECTIVES)])
    else:
        optimizer.step()
    _synchronize(device)
    return time.perf_counter() - start


def _warm_up_process(master: list[Tensor], grads: list[Tensor], device: str, steps: int = 3) -> None:
    """A few untimed torch AdamW steps before any row, so the first row is not the one that warms the
    process up (the allocator's heap and mmap threshold, page faults, lazy imports): that made the baseline
    row's first steps several times slower than later rows' on a 2-core VM."""
    params = [torch.nn.Parameter(tensor.clone()) for tensor in master]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    optimizer = _torch_adamw(params)
    for _ in range(steps):
        optimizer.step()
    _synchronize(device)
    for param in params:
        param.grad = None
    del optimizer, params
    gc.collect()


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _run_row(
    row: Row,
    config: BenchConfig,
    master: list[Tensor],
    grads: list[Tensor],
    on_step: Callable[[], None],
) -> dict[str, Any]:
    params = [torch.nn.Parameter(tensor.clone()) for tensor in master]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad  # the same fixed gradients for every row; no optimizer here writes to them
    optimizer = None
    launches = multi_tensor.COUNTERS.launches
    try:
        optimizer = row.build(params)
        warmup_times, times = [], []
        for index in range(config.warmup + config.steps):
            elapsed = _step(optimizer, row, index, config.device)
            (warmup_times if index < config.warmup else times).append(elapsed)
            on_step()
        state = quant.optimizer_state_bytes(optimizer)
        moved = bytes_per_step(optimizer, params)
        median = statistics.median(times)
        return {
            "name": row.name,
            "description": row.description,
            "median_step_s": median,
            "first_step_s": warmup_times[0],
            "ratio_to_adamw": None,
            "state_bytes": state,
            "state_bytes_per_param": state / config.params,
            "bytes_per_step": moved,
            "gbps": moved / median / 1e9,
            "fraction_of_copy_bandwidth": None,
            "step_times_s": times,
            "multi_tensor_launches": multi_tensor.COUNTERS.launches - launches,
            "warmup_times_s": warmup_times,
        }
    finally:
        for param in params:
            param.grad = None
        del optimizer, params
        gc.collect()
        if config.device.startswith("cuda"):
            torch.cuda.empty_cache()


def optimizer_dry_run(config: BenchConfig, stability: bool) -> str:
    """`bench optimizer --dry-run`: the options checked (`BenchConfig.from_cli`), and what would be timed."""
    head = "doplus bench optimizer --dry-run: the options are valid; nothing was timed"
    if stability:
        return f"{head}\nwould run the stability rows (--stability) with seed {config.seed}"
    shapes, _ = synthetic_shapes(config.params)
    numel = sum(math.prod(shape) for shape in shapes)
    rows = ", ".join(row.name for row in config.rows())
    return (f"{head}\nwould time {rows} on {numel:,} synthetic {str(config.dtype).removeprefix('torch.')} "
            f"parameters ({len(shapes)} tensors) on {config.device}: {config.warmup} warm-up and {config.steps} timed "
            "steps each")


def run_optimizer_bench(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every selected row; returns a JSON-serialisable dict (see the module docstring for the fields)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    rows = config.rows()
    shapes, layout = synthetic_shapes(config.params)
    console = Console(stderr=True, highlight=False)
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not progress,
    )
    result: dict[str, Any] = {
        "device": config.device,
        "device_name": _device_name(config.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": _numel(shapes),
        "dtype": str(config.dtype).removeprefix("torch."),
        "steps": config.steps,
        "warmup": config.warmup,
        "seed": config.seed,
        "synthetic": {**layout, "tensors": len(shapes)},
        "copy_gbps": None,
        "rows": [],
    }
    with bar:
        task = bar.add_task("synthetic parameters, copy bandwidth, warm-up", total=None)
        master = _random_tensors(shapes, config.seed, PARAM_INIT_STD, config.dtype, config.device)
        grads = _random_tensors(shapes, config.seed + 1, GRAD_SCALE, config.dtype, config.device)
        _warm_up_process(master, grads, config.device)
        copy_gbps = measure_copy_gbps(result["params"], config.device)
        result["copy_gbps"] = copy_gbps
        bar.update(task, total=1, completed=1, description=f"copy bandwidth: {copy_gbps:.1f} GB/s")
        for row in rows:
            task = bar.add_task(row.name, total=config.warmup + config.steps)
            try:
                entry = _run_row(row, config, master, grads, lambda task=task: bar.advance(task))
                summary = f"{row.name}: {_format_seconds(entry['median_step_s'])}/step"
            except Exception as error:  # a broken row (no bitsandbytes, no kernel) must not end the run
                message = " ".join(f"{type(error).__name__}: {error}".split())
                entry = {"name": row.name, "description": row.description, "error": message}
                summary = f"{row.name}: [red]failed[/] ({escape(message[:80])})"
                gc.collect()
            result["rows"].append(entry)
            bar.update(task, description=summary, completed=config.warmup + config.steps)
        del master, grads
        gc.collect()
    baseline = next((r for r in result["rows"] if r["name"] == "adamw" and "error" not in r), None)
    for entry in result["rows"]:
        if "error" in entry:
            continue
        if baseline is not None:
            entry["ratio_to_adamw"] = entry["median_step_s"] / baseline["median_step_s"]
        entry["fraction_of_copy_bandwidth"] = entry["gbps"] / copy_gbps
    return result


# -- output ----------------------------------------------------------------------------------------------


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _format_count(count: int) -> str:
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def print_table(result: dict[str, Any], console=None) -> None:
    """The result as a rich table on stdout, captioned with the device, parameter count and copy bandwidth."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal and console.width < 120:  # piped or captured: do not squeeze to 80
            console = Console(highlight=False, width=120)
    table = Table(
        title=f"doplus bench optimizer — {_format_count(result['params'])} {result['dtype']} parameters",
        caption=(
            f"{result['device_name']} ({result['device']}, {result['threads']} threads, "
            f"torch {result['torch']}) · {result['params']:,} parameters · "
            f"copy bandwidth {result['copy_gbps']:.1f} GB/s · "
            f"median of {result['steps']} steps after {result['warmup']} warm-up"
        ),
    )
    table.add_column("optimizer", style="bold", no_wrap=True)
    for header in ("median step", "× AdamW", "first step", "state B/param", "state", "GB/s", "of copy BW"):
        table.add_column(header, justify="right", no_wrap=True)
    for row in result["rows"]:
        if "error" in row:
            table.add_row(row["name"], f"[red]error: {escape(row['error'])}[/]", *[""] * 6)
            continue
        ratio = row["ratio_to_adamw"]
        fraction = row["fraction_of_copy_bandwidth"]
        table.add_row(
            row["name"],
            _format_seconds(row["median_step_s"]),
            "–" if ratio is None else f"{ratio:.{'2f' if ratio >= 0.1 else '2g'}}×",
            _format_seconds(row["first_step_s"]),
            f"{row['state_bytes_per_param']:.2f}",
            bytes_text(row["state_bytes"]),
            f"{row['gbps']:.1f}",
            "–" if fraction is None else f"{fraction:.{0 if fraction >= 0.1 else 1}%}",
        )
    console.print(table)
