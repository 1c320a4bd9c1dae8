"""The ``openai`` package against ``/v1/completions``: plain and streamed, greedy and sampling, each equal to
``generate`` on the prompt alone (the streamed text is the plain text, token by token)."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.test_server import oracle

openai = pytest.importorskip("openai")


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def expected_text(server, prompt: str, params: dict, seed: int | None = None) -> tuple[str, list[int]]:
    ids = server.tokenizer(prompt)["input_ids"]
    sequences, _ = oracle(server.model, ids, params, seed)
    start = len(ids) if not server.model.config.is_encoder_decoder else 1
    new = sequences[0][start:]
    eos = server.model.generation_config.eos_token_id
    if eos in new:
        new = new[: new.index(eos)]
    return server.tokenizer.decode(new, skip_special_tokens=True), new


@pytest.mark.parametrize("server_name", ["gpt2_server", "bart_server"])
def test_plain_and_streamed_greedy(server_name, request):
    server = request.getfixturevalue(server_name)
    text, tokens = expected_text(server, "w5 w6 w7 w8", {"max_new_tokens": 12})
    answer = client(server).completions.create(model="tiny", prompt="w5 w6 w7 w8", max_tokens=12, temperature=0)
    assert answer.choices[0].text == text and text
    assert answer.usage.completion_tokens == len(tokens)
    chunks = list(
        client(server).completions.create(model="tiny", prompt="w5 w6 w7 w8", max_tokens=12, temperature=0, stream=True)
    )
    streamed = "".join(chunk.choices[0].text for chunk in chunks)
    assert streamed == text
    assert len(chunks) >= len(tokens)  # token by token, then the finish reason
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_reproducible_from_seed(gpt2_server):
    params = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 10}
    text, _ = expected_text(gpt2_server, "w9 w10", params, seed=123)
    openai_client = client(gpt2_server)
    kwargs = dict(model="tiny", prompt="w9 w10", max_tokens=10, temperature=0.7, top_p=0.9, seed=123)
    assert openai_client.completions.create(**kwargs).choices[0].text == text
    streamed = "".join(chunk.choices[0].text for chunk in openai_client.completions.create(stream=True, **kwargs))
    assert streamed == text


def test_beam_and_errors_through_openai(bart_server):
    openai_client = client(bart_server)
    text, _ = expected_text(bart_server, "w20 w21 w22", {"num_beams": 4, "max_new_tokens": 8})
    answer = openai_client.completions.create(
        model="tiny", prompt="w20 w21 w22", max_tokens=8, temperature=0, extra_body={"num_beams": 4}
    )
    assert answer.choices[0].text == text
    with pytest.raises(openai.BadRequestError, match="stop is not supported"):
        openai_client.completions.create(model="tiny", prompt="w5", stop=["w9"])
    with pytest.raises(openai.NotFoundError, match="not served here"):
        openai_client.completions.create(model="gpt-4", prompt="w5")
    # several prompts and n samples: choices indexed prompt * n + sample, as OpenAI's
    response = httpx.post(
        f"{bart_server.url}/v1/completions",
        json={"prompt": ["w5 w6", "w7"], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 4},
        timeout=60,
    )
    assert [choice["index"] for choice in response.json()["choices"]] == [0, 1, 2, 3]
