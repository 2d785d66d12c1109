"""Each way a hub fetch fails is its own line: a local HTTP server on 127.0.0.1 stands in for the hub, reached
through huggingface_hub's own endpoint setting, and answers as the hub does (404 with X-Error-Code: RepoNotFound,
403 with X-Error-Code: GatedRepo, a bare 401 or 403, 500) or holds every request past the client's timeout
(transformers' revision look-up included, which huggingface_hub sends without a timeout of its own: doplus
bounds it). The model loader the commands use and an `hf:` data source are loaded through it; no request leaves
the machine."""

from __future__ import annotations

import http.server
import select
import socket
import threading
import time

import pytest

from doplus_cli import hub_errors, models
from doplus_cli.data.sources import HubSource
from doplus_cli.errors import UserError
from doplus_cli.hub_errors import HubError, diagnose, error_chain
from tests.helpers import run_cli

WAIT_S = 0.5  # huggingface_hub's timeouts here (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT)
# How long the "never answers" repository holds a request at most: until the client gives up (closes its end)
# or this long, then it closes without a word. Far above WAIT_S, so that a client starved of CPU on a loaded
# machine still sees its own timeout first, never the stand-in's close (a dropped connection, "unreachable").
HOLD_S = 30.0

# The repository's name says how the stand-in hub answers every request about it: (status, headers).
ANSWERS = {
    "answers-404": (404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}),
    "answers-gated": (403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"}),
    "answers-401": (401, {}),
    "answers-403": (403, {}),
    "answers-500": (500, {}),
}


class StandInHub(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    release = threading.Event()
    requests: list[str] = []

    def log_message(self, *args):  # the requests are kept in `requests`, not printed
        pass

    def answer(self):
        type(self).requests.append(f"{self.command} {self.path}")
        body = b'{"error": "stand-in hub"}'
        if "answers-never" in self.path:
            self.hold()
            self.close_connection = True
            return
        name = next((n for n in ANSWERS if n in self.path), None)
        status, headers = ANSWERS[name] if name else (404, {})  # anything else (the agents registry): 404
        self.send_response(status)
        for key, value in {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def hold(self) -> None:
        """Wait until the client closes the connection, the module ends, or HOLD_S has passed."""
        deadline = time.monotonic() + HOLD_S
        while not self.release.is_set() and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if readable:
                if self.connection.recv(1, socket.MSG_PEEK):  # more bytes: keep holding, without a busy loop
                    self.release.wait(deadline - time.monotonic())
                return  # b"": the client gave up

    do_GET = do_HEAD = do_POST = answer


@pytest.fixture(scope="module")
def hub_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    StandInHub.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed when the block ends: a connection to it is refused


def point_the_hub_at(monkeypatch, endpoint: str) -> None:
    """huggingface_hub and datasets read HF_ENDPOINT, HF_HUB_OFFLINE and the timeouts when imported (the suite
    sets offline mode for every test): their read values are set here. huggingface_hub retries a failed
    request 5 times, 1 to 8 s apart (about 23 s), and its second try waits 60 s: one try each here, since the
    line said after the last try is the same."""
    import datasets.config
    import huggingface_hub.constants as constants
    import huggingface_hub.file_download as file_download
    import transformers.utils.hub
    from huggingface_hub.utils import _http

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", WAIT_S)  # the variables take whole seconds; 0.5 s here
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", WAIT_S)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL", endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(file_download, "_ETAG_RETRY_TIMEOUT", WAIT_S)
    monkeypatch.setattr(_http.http_backoff, "__kwdefaults__", {**_http.http_backoff.__kwdefaults__, "max_retries": 0})
    # transformers keeps one HfApi, made with the endpoint of its first use (one per process outside the tests)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)


# kind -> (repository, what the line must say, a piece of the hub's own message that --debug keeps: through
# transformers, through datasets)
CASES = {
    hub_errors.NOT_FOUND: ("answers-404", "not found on the hub at {endpoint} (404): check the id's spelling",
                           "Repository Not Found", "Repository Not Found"),
    hub_errors.GATED: ("answers-gated", "a gated repository on the hub (403): log in with `hf auth login`",
                       "Access to this model is restricted", "Access to this model is restricted"),
    hub_errors.UNAUTHORISED + "-401": ("answers-401", "the hub refused without a valid login (401): log in with",
                                       "401 Unauthorized", "401 Unauthorized"),
    hub_errors.UNAUTHORISED + "-403": ("answers-403", "the hub refused this account (403): log in with",
                                       "403 Forbidden", "403 Forbidden"),
    hub_errors.SERVER: ("answers-500", "the hub at {endpoint} answered with a server error (500): retry later",
                        "500 Internal Server Error", "500 Internal Server Error"),
    hub_errors.TIMEOUT: ("answers-never", "the hub at {endpoint} did not answer in time: retry, or allow longer "
                         "with HF_HUB_ETAG_TIMEOUT (now 0.5 s) and HF_HUB_DOWNLOAD_TIMEOUT (now 0.5 s)",
                         "timed out", "timed out"),
    hub_errors.UNREACHABLE: ("anything", "not in the local Hugging Face cache and the hub at {endpoint} cannot be "
                             "reached (Connection refused): check the network", "[Errno", "[Errno"),
    hub_errors.OFFLINE: ("anything", "not in the local Hugging Face cache, and offline mode is set (HF_HUB_OFFLINE)",
                         "outgoing traffic has been disabled", "(OfflineModeIsEnabled)"),
}


def arrange(case: str, monkeypatch, hub_server: str, dataset: bool = False) -> tuple[str, str, str, str]:
    """Point the hub at the stand-in (a closed port for `unreachable`; offline mode for `offline`); return
    (repository, endpoint, the line's expected words, the original message's words)."""
    repo, line, original, original_from_datasets = CASES[case]
    original = original_from_datasets if dataset else original
    endpoint = f"http://127.0.0.1:{closed_port()}" if case == hub_errors.UNREACHABLE else hub_server
    point_the_hub_at(monkeypatch, endpoint)
    if case == hub_errors.OFFLINE:
        import datasets.config
        import huggingface_hub.constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return f"doplus-tests/{repo}", endpoint, line.format(endpoint=endpoint), original


def kind_of(case: str) -> str:
    return case.split("-")[0]


def assert_one_line(error: UserError, spec: str, line: str, original: str, case: str) -> None:
    message = str(error)
    assert isinstance(error, HubError) and error.kind == kind_of(case) and error.exit_code == 2
    assert message.startswith(f"{spec}: ") and line in message, message
    assert "\n" not in message and message.endswith("(--debug shows the hub's own message)")
    # the hub's own words are not in the line but stay chained for --debug's traceback
    chained = " ".join(str(e) for e in error_chain(error)[1:])
    assert original in chained and original not in message


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_that_does_not_load_from_the_hub_says_why_in_one_line(case, monkeypatch, hub_server):
    spec, endpoint, line, original = arrange(case, monkeypatch, hub_server)
    StandInHub.requests.clear()
    with pytest.raises(UserError) as raised:
        models.load_model_and_tokenizer(spec)
    assert_one_line(raised.value, spec, line, original, case)
    assert "--model DIR" in str(raised.value) or kind_of(case) not in (hub_errors.OFFLINE, hub_errors.UNREACHABLE,
                                                                        hub_errors.TIMEOUT)
    asked = [r for r in StandInHub.requests if spec in r]
    assert bool(asked) == (case not in (hub_errors.UNREACHABLE, hub_errors.OFFLINE)), StandInHub.requests


@pytest.mark.parametrize("case", list(CASES))
def test_an_hf_data_source_that_does_not_load_says_why_in_one_line(case, monkeypatch, hub_server):
    spec, endpoint, line, original = arrange(case, monkeypatch, hub_server, dataset=True)
    with pytest.raises(UserError) as raised:
        HubSource(f"hf:{spec}")
    assert_one_line(raised.value, f"hf:{spec}", line.replace("(HF_HUB_OFFLINE)", ""), original, case)
    assert "export it to JSON lines" in str(raised.value) or kind_of(case) not in (
        hub_errors.OFFLINE, hub_errors.UNREACHABLE, hub_errors.TIMEOUT)
    if kind_of(case) in (hub_errors.GATED, hub_errors.UNAUTHORISED):
        assert f"{endpoint}/datasets/{spec}" in str(raised.value)  # where to accept its licence: the dataset's page


def test_the_command_exits_2_with_one_line_and_debug_shows_the_hubs_message(monkeypatch, hub_server, tmp_path,
                                                                             capsys):
    """`doplus unlearn` in this process, as a user runs it: a typo'd model id is one line and exit code 2;
    with --debug the traceback carries the hub's own 404 message."""
    spec, endpoint, line, original = arrange(hub_errors.NOT_FOUND, monkeypatch, hub_server)
    rows = '{"question": "Who wrote it?", "answer": "Nobody."}\n'
    (tmp_path / "forget.jsonl").write_text(rows)
    (tmp_path / "retain.jsonl").write_text(rows)
    args = ["unlearn", "--model", spec, "--forget", tmp_path / "forget.jsonl", "--retain", tmp_path / "retain.jsonl",
            "--steps", 1, "--loss", "GA+GD"]
    capsys.readouterr()
    assert run_cli(*args, "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {spec}: ") and line in err and "\n" not in err and "Traceback" not in err
    with pytest.raises(HubError) as raised:  # --debug re-raises: the console script prints the traceback
        run_cli("--debug", *args, "--out", tmp_path / "b")
    assert original in " ".join(str(e) for e in error_chain(raised.value))


def test_the_hubs_answers_win_over_what_wraps_them(monkeypatch):
    """The classification alone, on chains built by hand as transformers and datasets build them."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    def chained(outer: BaseException, inner: BaseException) -> BaseException:
        outer.__cause__ = inner
        return outer

    request = httpx2.Request("HEAD", "http://127.0.0.1/org/model/resolve/main/config.json")
    server_error = HfHubHTTPError("503", response=httpx2.Response(503, request=request))
    # a 503 under LocalEntryNotFoundError under transformers' OSError: a server error, not "cannot reach"
    wrapped = chained(OSError("We couldn't connect"), chained(LocalEntryNotFoundError("no cache"), server_error))
    assert diagnose(wrapped) == hub_errors.Diagnosis(hub_errors.SERVER, 503)
    limited = HfHubHTTPError("429", response=httpx2.Response(429, request=request))
    assert diagnose(limited).kind == hub_errors.RATE_LIMITED
    missing_file = httpx2.Request("HEAD", "http://127.0.0.1/org/model/resolve/main/tokenizer.json")
    from huggingface_hub.errors import RemoteEntryNotFoundError

    entry = RemoteEntryNotFoundError("404", response=httpx2.Response(404, request=missing_file))
    assert diagnose(entry) == hub_errors.Diagnosis(hub_errors.FILE, 404, "tokenizer.json")
    # a name that does not resolve: unreachable, with the resolver's reason
    dns = chained(LocalEntryNotFoundError("no cache"), socket.gaierror(-2, "Name or service not known"))
    assert diagnose(dns) == hub_errors.Diagnosis(hub_errors.UNREACHABLE, None, "Name or service not known")
    # nothing from fetching: the caller's own message fits, in offline mode too
    assert diagnose(ValueError("Unrecognized configuration class")) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert diagnose(ValueError("Unrecognized configuration class")) is None
    assert diagnose(chained(OSError("cannot load"), LocalEntryNotFoundError("no cache"))).kind == hub_errors.OFFLINE


@pytest.mark.parametrize("case", [hub_errors.GATED, hub_errors.SERVER])
def test_a_judge_model_that_does_not_load_says_why(case, monkeypatch, hub_server):
    """An NLI judge is left out with the reason (the run goes on); a guard model is a one-line error."""
    from doplus_cli.evaluation.judges import load_nli
    from doplus_cli.evaluation.safety_judges import load_guard

    spec, endpoint, line, original = arrange(case, monkeypatch, hub_server)
    monkeypatch.setattr(models, "_REACHABLE", {})  # the judges' DNS probe: 127.0.0.1 resolves
    judge, reason = load_nli(spec)
    assert judge is None and reason.startswith(f"no NLI model: '{spec}' could not be loaded ({line}")
    with pytest.raises(UserError) as raised:
        load_guard(spec, "cpu")
    assert str(raised.value).startswith(f"guard model '{spec}' could not be loaded ({line}")
    assert original in " ".join(str(e) for e in error_chain(raised.value)[1:])


def test_tofu_from_the_hub_says_the_hub_cannot_be_reached(monkeypatch, hub_server):
    from doplus_cli.evaluation.suites import load_tofu_sets

    spec, endpoint, line, original = arrange(hub_errors.UNREACHABLE, monkeypatch, hub_server, dataset=True)
    with pytest.raises(HubError) as raised:
        load_tofu_sets("forget01", None, max_samples=2)
    message = str(raised.value)
    assert message.startswith("hf:locuslab/TOFU:forget01_perturbed: ") and line in message
    assert "or pass --data-dir with the TOFU JSON-lines files" in message


def test_an_lm_eval_tasks_dataset_refused_by_the_hub_is_one_line(monkeypatch, hub_server, tmp_path):
    """datasets raises the hub's 401 as it comes: one line, never a traceback."""
    from lm_eval.tasks import TaskManager

    from doplus_cli.evaluation.lm_eval_suite import load_tasks

    spec, endpoint, line, original = arrange(hub_errors.UNAUTHORISED + "-401", monkeypatch, hub_server)
    (tmp_path / "refused.yaml").write_text(
        f"task: refused_task\ndataset_path: {spec}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: label\n")
    with pytest.raises(HubError) as raised:
        load_tasks(TaskManager(include_path=str(tmp_path), include_defaults=False), ["refused_task"])
    assert str(raised.value).startswith(f"lm-eval task 'refused_task': its dataset: {line}")
    assert "its page on the hub" in str(raised.value)


def test_a_request_sent_without_a_timeout_gets_one(monkeypatch, hub_server):
    """huggingface_hub's repo_info (transformers' revision look-up) sends no timeout: without doplus's bound it
    would wait until the stand-in closes the connection (HOLD_S) and end as a dropped connection; with it, it
    times out after HF_HUB_DOWNLOAD_TIMEOUT."""
    from huggingface_hub import HfApi

    spec, endpoint, line, original = arrange(hub_errors.TIMEOUT, monkeypatch, hub_server)
    hub_errors.bound_hub_waits()
    with pytest.raises(Exception) as raised:
        HfApi(endpoint=endpoint).model_info(spec)
    assert diagnose(raised.value) == hub_errors.Diagnosis(hub_errors.TIMEOUT, None, "timed out")


def test_a_client_huggingface_hub_makes_anew_gets_the_bound_at_the_next_load():
    """huggingface_hub closes its shared client after a fork (and when another client factory is set) and makes a
    new one on the next request: the bound goes on that one at doplus's next load, once."""
    from huggingface_hub import close_session, get_session

    hub_errors.bound_hub_waits()
    assert hub_errors._bound in get_session().event_hooks["request"]
    close_session()  # as in a forked process
    hub_errors.bound_hub_waits()
    hub_errors.bound_hub_waits()
    assert get_session().event_hooks["request"].count(hub_errors._bound) == 1
