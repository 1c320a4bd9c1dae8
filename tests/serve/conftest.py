"""Servers for the serving tests: tiny random models with a word-level tokenizer, under a real uvicorn on
127.0.0.1 (a free port), in a thread of the test process (the oracle runs on the same model objects)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import uvicorn

from fastgen.serve import create_app
from tests import harness


def word_tokenizer(encoder_decoder: bool):
    """A word-level tokenizer over the tiny models' vocabulary: ``w3 .. w95``, specials ``<s> <pad> </s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": harness.BOS, "<pad>": harness.PAD, "</s>": harness.EOS}
    vocab.update({f"w{i}": i for i in range(3, harness.VOCAB)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder_decoder:
        core.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", harness.BOS), ("</s>", harness.EOS)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Running:
    """A server in a thread: ``url``, its ``app`` and ``model``."""

    def __init__(self, model: Any, tokenizer: Any, **options: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.app = create_app(model, tokenizer, name="tiny", **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def engine(self):
        return self.app.state.served.engine


@contextlib.contextmanager
def serving(model: Any, tokenizer: Any = None, **options: Any) -> Iterator[Running]:
    with Running(model, tokenizer, **options) as running:
        yield running


def bart():
    return harness.tiny_hf_model("bart")


def gpt2():
    model = harness.tiny_hf_model("gpt2")
    return model


@pytest.fixture(scope="module")
def bart_server() -> Iterator[Running]:
    torch.manual_seed(0)
    with serving(bart(), word_tokenizer(True), batch_rows=16) as running:
        yield running


@pytest.fixture(scope="module")
def gpt2_server() -> Iterator[Running]:
    with serving(gpt2(), word_tokenizer(False), batch_rows=16) as running:
        yield running
