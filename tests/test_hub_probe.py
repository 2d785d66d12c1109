"""Judge models on a machine without a network and without HF_HUB_OFFLINE: one quick DNS probe instead of
huggingface_hub's retries (about 30 s per model), and the reason says why the judge is missing."""

from __future__ import annotations

import socket
import time

import pytest

from doplus_cli import models
from doplus_cli.evaluation import judges


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(models, "_REACHABLE", {})


def test_an_unresolvable_hub_loads_judges_from_the_cache_only(no_network, monkeypatch):
    import transformers

    calls = []

    def from_pretrained(name, **kwargs):
        calls.append(kwargs.get("local_files_only"))
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert not models.hub_offline() and not models.hub_reachable() and models.judge_files_only()
    judge, reason = judges.load_nli("doplus-tests/no-such-nli-model")
    assert judge is None and calls == [True]
    assert "the hub's host does not resolve (no network)" in reason


def test_a_resolvable_hub_is_tried_and_the_answer_is_kept(monkeypatch):
    seen = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: seen.append(host) or [])
    monkeypatch.setattr(models, "_REACHABLE", {})
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    assert models.hub_reachable() and models.hub_reachable() and not models.judge_files_only()
    assert seen == ["hub.example.org"]  # probed once per process


def test_a_probe_that_hangs_counts_as_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port: time.sleep(5))
    monkeypatch.setattr(models, "_REACHABLE", {})
    assert not models.hub_reachable(timeout=0.2)
