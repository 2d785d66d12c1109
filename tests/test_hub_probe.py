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
    """The real loaders, with huggingface_hub online (its offline switch, read at import, turned off): two judges
    are given up at once, with one DNS lookup in all (the probe) and no request of huggingface_hub's own."""
    import huggingface_hub.constants

    lookups = []

    def refuse(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert not models.hub_offline() and not models.hub_reachable() and models.judge_files_only()
    assert lookups == ["huggingface.co"]
    judge, reason = judges.load_nli("doplus-tests/no-such-nli-model")
    embedder, embedder_reason = judges.load_embedder("doplus-tests/no-such-embedder")
    assert judge is None and "the hub's host does not resolve (no network)" in reason
    assert embedder is None and embedder_reason
    assert lookups == ["huggingface.co"]  # huggingface_hub never tried the network (its retries take ~30 s a model)


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
