"""Why a model, tokenizer or dataset could not be fetched from the Hugging Face hub, said in one line.

huggingface_hub raises one exception type per answer of the hub (RepositoryNotFoundError, GatedRepoError,
RevisionNotFoundError, an HfHubHTTPError carrying the response, LocalEntryNotFoundError when nothing could be
fetched and nothing is cached, OfflineModeIsEnabled) and lets the transport's own errors (a timeout, a refused
connection) through. transformers and datasets wrap them in an OSError, a ConnectionError or their own types with
the hub's error chained as the cause, so `hub_error` walks the chain and names the first thing the hub (or the
network) said. Each kind is its own line with what to do about it; the original error stays chained for
`--debug`, which prints the whole traceback.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

from doplus_cli.errors import UserError

# The kinds of failure, each its own line (hub_line)
NOT_FOUND, REVISION, FILE, GATED, UNAUTHORISED = "not found", "revision", "file", "gated", "unauthorised"
RATE_LIMITED, SERVER, HTTP = "rate limited", "server", "http"
TIMEOUT, OFFLINE, UNREACHABLE = "timeout", "offline", "unreachable"
KINDS = (NOT_FOUND, REVISION, FILE, GATED, UNAUTHORISED, RATE_LIMITED, SERVER, HTTP, TIMEOUT, OFFLINE, UNREACHABLE)

LOGIN = "log in with `hf auth login` (or `huggingface-cli login`, or set HF_TOKEN)"


class HubError(UserError):
    """A hub fetch that failed, in one line; `kind` is one of KINDS and the hub's own error is the cause."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Diagnosis:
    """What a failed fetch came to: one of KINDS, the HTTP status when the hub answered, and a short detail
    (the missing file's name, the transport's reason)."""

    kind: str
    status: int | None = None
    detail: str = ""


def offline_mode(*also: str) -> bool:
    """Whether Hugging Face offline mode is set: HF_HUB_OFFLINE (or one of the variables in `also`) in the
    environment, or huggingface_hub's own switch (read from the environment when it was imported)."""
    if any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on") for name in ("HF_HUB_OFFLINE", *also)):
        return True
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    return False


def endpoint() -> str:
    """The hub doplus fetches from: HF_ENDPOINT as huggingface_hub read it, else https://huggingface.co."""
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        return constants.ENDPOINT
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and every error it was raised from or while handling, outermost first, each once."""
    chain: list[BaseException] = []
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if any(current is seen for seen in chain):
            continue
        chain.append(current)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return chain


def _types(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes `module:Name` that are installed (huggingface_hub's HTTP layer changed from
    requests to httpx and httpx2 across versions; whichever is there is checked)."""
    import importlib

    found: list[type[BaseException]] = []
    for name in names:
        module, _, attribute = name.partition(":")
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), attribute))
    return tuple(found)


def _timeout_types() -> tuple[type[BaseException], ...]:
    return (TimeoutError, *_types("httpx2:TimeoutException", "httpx:TimeoutException", "requests:Timeout"))


def _connection_types() -> tuple[type[BaseException], ...]:
    return (ConnectionError, socket.gaierror, socket.herror, *_types(
        "httpx2:NetworkError", "httpx2:RemoteProtocolError", "httpx2:ProxyError", "httpx2:UnsupportedProtocol",
        "httpx:NetworkError", "httpx:RemoteProtocolError", "httpx:ProxyError", "httpx:UnsupportedProtocol",
        "requests:ConnectionError",
    ))


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _missing_file(error: BaseException) -> str:
    """The file named by a 404's URL (…/resolve/REVISION/FILE)."""
    url = str(getattr(getattr(error, "response", None), "url", "") or "")
    return url.split("/resolve/", 1)[1].split("/", 1)[-1] if "/resolve/" in url else ""


def diagnose(error: BaseException, *offline_variables: str) -> Diagnosis | None:
    """What the hub or the network said, from `error`'s chain; None when nothing in it came from fetching
    (a model folder without weights, a dataset config that does not exist: the caller's own message fits).

    The hub's answers win over the transport's: a LocalEntryNotFoundError caused by a 500 is a server error.
    Offline mode wins over all: nothing was asked of the hub. `offline_variables`: more variables that switch
    offline mode on for this caller (HF_DATASETS_OFFLINE for datasets)."""
    chain = error_chain(error)
    hub = _types("huggingface_hub.errors:OfflineModeIsEnabled", "huggingface_hub.errors:GatedRepoError",
                 "huggingface_hub.errors:RevisionNotFoundError", "huggingface_hub.errors:RepositoryNotFoundError",
                 "huggingface_hub.errors:RemoteEntryNotFoundError", "huggingface_hub.errors:LocalEntryNotFoundError",
                 "datasets.exceptions:DatasetNotFoundError")
    names = {cls.__name__: cls for cls in hub}

    def first(name: str) -> BaseException | None:
        cls = names.get(name)
        return next((e for e in chain if cls is not None and isinstance(e, cls)), None)

    statuses = [status for e in chain if (status := _status(e)) is not None]  # the hub's answers, outermost first
    transport = _timeout_types() + _connection_types()
    fetched = any(isinstance(e, transport) for e in chain) or any(
        first(name) is not None for name in ("LocalEntryNotFoundError", "DatasetNotFoundError"))
    if first("OfflineModeIsEnabled") is not None or (offline_mode(*offline_variables) and fetched and not statuses):
        return Diagnosis(OFFLINE)
    if (gated := first("GatedRepoError")) is not None:
        return Diagnosis(GATED, _status(gated))
    if (revision := first("RevisionNotFoundError")) is not None:
        return Diagnosis(REVISION, _status(revision))
    if (missing := first("RepositoryNotFoundError")) is not None:
        return Diagnosis(NOT_FOUND, _status(missing))
    if (entry := first("RemoteEntryNotFoundError")) is not None:
        return Diagnosis(FILE, _status(entry), _missing_file(entry))
    for status in statuses:
        if status in (401, 403):
            return Diagnosis(UNAUTHORISED, status)
        if status == 404:
            return Diagnosis(NOT_FOUND, status)
        if status == 429:
            return Diagnosis(RATE_LIMITED, status)
        if status >= 500:
            return Diagnosis(SERVER, status)
        if status >= 400:
            return Diagnosis(HTTP, status)
    if (timeout := next((e for e in chain if isinstance(e, _timeout_types())), None)) is not None:
        return Diagnosis(TIMEOUT, detail=" ".join(str(timeout).split())[:120])
    if (dataset := first("DatasetNotFoundError")) is not None:  # datasets keeps only its own message
        return Diagnosis(GATED if "gated" in str(dataset) else NOT_FOUND)
    connection = next((e for e in chain if isinstance(e, _connection_types())), None)
    if connection is not None:
        return Diagnosis(UNREACHABLE, detail=_transport_reason(chain))
    if first("LocalEntryNotFoundError") is not None:  # nothing fetched and nothing cached, no reason given
        return Diagnosis(UNREACHABLE)
    return None


def _transport_reason(chain: list[BaseException]) -> str:
    """The innermost reason the transport gave ("[Errno 111] Connection refused", "Name or service not
    known"), without the wrappers' sentences."""
    for error in reversed(chain):
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
    innermost = " ".join(str(chain[-1]).split())
    return innermost[:120]


def _bound(request) -> None:
    """A request hook: a request sent without a timeout waits at most HF_HUB_DOWNLOAD_TIMEOUT seconds (read at each
    request) to connect and for each part of the answer; a request with its own timeout keeps it."""
    from huggingface_hub import constants

    timeout = request.extensions.get("timeout")
    if isinstance(timeout, dict) and None in timeout.values():
        seconds = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
        request.extensions["timeout"] = {key: seconds if value is None else value for key, value in timeout.items()}


def bound_hub_waits() -> None:
    """Give each request huggingface_hub sends without a timeout one: transformers looks a model's revision up
    (`HfApi.repo_info`) with none, so a hub that accepts the connection and never answers would hold a load for
    good, and the timeout line would never be said. Called before doplus loads from the hub: it adds `_bound` to
    the request hooks of the client huggingface_hub shares (its public `get_session`) unless that client has it,
    so a client made anew (after a fork, or by another client factory) gets it at the next load. A
    huggingface_hub whose client takes no request hooks (before 1.0, on requests) is left as it is."""
    try:
        from huggingface_hub import get_session
    except ImportError:
        return
    client = get_session()
    hooks = getattr(client, "event_hooks", None)
    if not isinstance(hooks, dict) or _bound in hooks.get("request", ()):
        return
    client.event_hooks = {**hooks, "request": [*hooks.get("request", ()), _bound]}


def _seconds(name: str) -> str:
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        return f"{getattr(constants, name)} s"
    return "10 s"


def hub_line(spec: str, diagnosis: Diagnosis, then: str = "", repo: str | None = None, dataset: bool = False) -> str:
    """The one line for `spec` (what the user wrote: a hub id, `hf:NAME:CONFIG`) that failed as `diagnosis` says.
    `repo`: the repository's id (default: `spec`; "": not known); `dataset`: a dataset repository; `then`: what
    the user can do instead where the hub cannot help (offline, unreachable, too slow); default: download it
    elsewhere."""
    kind, status, where = diagnosis.kind, diagnosis.status, endpoint()
    repo = spec if repo is None else repo
    page = (f"{where}/datasets/{repo}" if dataset else f"{where}/{repo}") if repo else "its page on the hub"
    flags = " --repo-type dataset" if dataset else ""
    download = f"`hf download {repo or 'ID'}{flags}`"
    code = f" ({status})" if status else ""
    tail = f"; {then or f'or download it where the hub is reachable ({download})'}"
    if kind == OFFLINE:
        return (f"{spec}: not in the local Hugging Face cache, and offline mode is set (HF_HUB_OFFLINE): unset it "
                f"to fetch it{tail}")
    if kind == GATED:
        return (f"{spec}: a gated repository on the hub{code}: {LOGIN} with an account that accepted its licence "
                f"on {page}")
    if kind == REVISION:
        return f"{spec}: the hub has the repository but not this revision{code}: check the revision's spelling"
    if kind == NOT_FOUND:
        return (f"{spec}: not found on the hub at {where}{code}: check the id's spelling; a private repository is "
                f"only found once you {LOGIN}")
    if kind == FILE:
        name = f" {diagnosis.detail}" if diagnosis.detail else " a file it needs"
        return f"{spec}: the repository on the hub has no{name}{code}: check the id and revision"
    if kind == UNAUTHORISED:
        why = "refused without a valid login" if status == 401 else "refused this account"
        return (f"{spec}: the hub {why}{code}: {LOGIN}; a token needs read access, and a gated repository "
                f"needs its licence accepted on {page}")
    if kind == RATE_LIMITED:
        return f"{spec}: the hub's rate limit was reached{code}: retry later, or {LOGIN} for a higher limit"
    if kind == SERVER:
        return f"{spec}: the hub at {where} answered with a server error{code}: retry later"
    if kind == HTTP:
        return f"{spec}: the hub at {where} refused the request{code}"
    if kind == TIMEOUT:
        return (f"{spec}: the hub at {where} did not answer in time: retry, or allow longer with "
                f"HF_HUB_ETAG_TIMEOUT (now {_seconds('HF_HUB_ETAG_TIMEOUT')}) and HF_HUB_DOWNLOAD_TIMEOUT "
                f"(now {_seconds('HF_HUB_DOWNLOAD_TIMEOUT')}){tail}")
    reason = f" ({diagnosis.detail})" if diagnosis.detail else ""
    return (f"{spec}: not in the local Hugging Face cache and the hub at {where} cannot be reached{reason}: "
            f"check the network, a proxy (HTTPS_PROXY) and HF_ENDPOINT{tail}")


def hub_error(spec: str, error: BaseException, then: str = "", repo: str | None = None, dataset: bool = False,
              diagnosis: Diagnosis | None = None) -> HubError | None:
    """The one-line HubError for `error`, raised while fetching `spec` from the hub (`diagnosis`: already made;
    default: `diagnose(error)`); None when nothing in its chain came from fetching. Raise it `from error`, so
    that `--debug` shows the original."""
    diagnosis = diagnosis or diagnose(error)
    if diagnosis is None:
        return None
    line = hub_line(spec, diagnosis, then, repo, dataset)
    return HubError(f"{line} (--debug shows the hub's own message)", diagnosis.kind)


def dataset_error(spec: str, name: str, error: BaseException, then: str = "") -> HubError | None:
    """`hub_error` for the hub dataset `name` (`spec`: as the user wrote it) that `datasets.load_dataset` could
    not load. datasets keeps the hub's error only as text ("Couldn't reach 'NAME' on the Hub
    (LocalEntryNotFoundError)", "doesn't exist on the Hub or cannot be accessed"), so unless offline mode
    explains it or the hub's answer is still chained, the hub is asked once more, for the dataset's info, and
    what that raises is said. The HubError's cause is that answer (itself chained to `error`): raise it
    `from` its `__cause__`, and `--debug` shows both."""
    diagnosis, cause = diagnose(error, "HF_DATASETS_OFFLINE"), error
    if diagnosis is None or (diagnosis.status is None and diagnosis.kind != OFFLINE):
        try:
            from huggingface_hub import HfApi, constants

            HfApi(endpoint=endpoint()).dataset_info(name, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except Exception as probe:  # whatever it is, diagnose says what came from the hub
            if (answer := diagnose(probe, "HF_DATASETS_OFFLINE")) is not None:
                diagnosis, cause = answer, probe
    if diagnosis is None:
        return None
    failure = hub_error(spec, cause, then, repo=name, dataset=True, diagnosis=diagnosis)
    if failure is not None:
        failure.__cause__ = cause
    return failure
