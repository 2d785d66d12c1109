import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from tests.tiny_model import TOFU, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with a plain (no chat template) BPE tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_llama(tmp_path_factory):
    """The same tiny Llama with a chat template on its tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-chat-llama"), chat=True)


@pytest.fixture(scope="session")
def tofu_dir():
    assert TOFU.is_dir(), f"TOFU data expected at {TOFU} (set DOPLUS_SHARED to the shared folder)"
    return TOFU
