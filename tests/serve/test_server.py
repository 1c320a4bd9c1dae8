"""The server against the oracle: many concurrent requests (httpx, async) of mixed settings, each result equal
to upstream ``generate`` on that input alone (greedy and beam search token for token, beam scores within a few
ulps; sampling equal under the request's seed); the endpoints' errors and metrics."""

from __future__ import annotations

import asyncio
import gc
import random

import httpx
import pytest
import torch

import fastgen
from tests import harness
from tests.serve.conftest import bart, serving, word_tokenizer

PARAMS = [
    {"max_new_tokens": 12},
    {"num_beams": 4, "max_new_tokens": 10},
    {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 8, "length_penalty": 0.7},
    {"do_sample": True, "top_k": 20, "temperature": 0.8, "max_new_tokens": 9},
    {"num_beams": 2, "no_repeat_ngram_size": 2, "max_new_tokens": 10},
]


def oracle(model, ids: list[int], params: dict, seed: int | None):
    """Upstream ``generate`` on this input alone (the sampling seed as fastgen-serve promises it)."""
    kwargs = dict(params)
    tensor = torch.tensor([ids])
    with fastgen.unpatched(), torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(
            input_ids=tensor,
            attention_mask=torch.ones_like(tensor),
            return_dict_in_generate=True,
            output_scores=True,
            **kwargs,
        )
    scores = getattr(out, "sequences_scores", None)
    return out.sequences.tolist(), None if scores is None else scores.tolist()


def requests(count: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    made = []
    for number in range(count):
        ids = [rng.randrange(3, harness.VOCAB) for _ in range(rng.randrange(2, 30))]
        params = dict(PARAMS[number % len(PARAMS)])
        if params.get("do_sample"):
            params["seed"] = rng.randrange(1000)
        made.append((ids, params))
    return made


async def _send_all(url: str, made: list[tuple[list[int], dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        calls = [client.post("/v1/generate", json={"input_ids": ids, "parameters": params}) for ids, params in made]
        return await asyncio.gather(*calls)


def check_against_oracle(model, made, responses) -> None:
    wrong = []
    for number, ((ids, params), response) in enumerate(zip(made, responses, strict=True)):
        assert response.status_code == 200, response.text
        result = response.json()["results"][0]
        params = dict(params)
        seed = params.pop("seed", None)
        expected, scores = oracle(model, ids, params, seed)
        got = [row["token_ids"] for row in result["sequences"]]
        if got != expected:
            wrong.append((number, params, got, expected))
            continue
        if scores is not None:
            logit_scale = 300.0  # tiny random models: scores within a few ulps of the step's logits
            for row, score in zip(result["sequences"], scores, strict=True):
                assert abs(row["score"] - score) <= 1e-6 * logit_scale, (number, row["score"], score)
        if seed is not None:
            assert result["seed"] == seed
    assert not wrong, f"{len(wrong)} of {len(made)} differ, first: {wrong[0]}"


@pytest.mark.parametrize("server", ["bart_server", "gpt2_server"])
def test_concurrent_requests_equal_generate_alone(server, request):
    running = request.getfixturevalue(server)
    # 100 concurrent requests on BART; 50 on gpt2 (the oracle, not the server, is what takes the time)
    made = requests(100, seed=1) if server == "bart_server" else requests(50, seed=2)
    responses = asyncio.run(_send_all(running.url, made))
    check_against_oracle(running.model, made, responses)
    stats = running.engine.stats
    assert stats.steps > 0 and stats.rows / stats.steps > 1.5  # requests shared steps
    assert running.engine.queue_depth == 0


def test_texts_in_texts_out_and_several_inputs(bart_server):
    with httpx.Client(base_url=bart_server.url, timeout=60) as client:
        body = {"inputs": ["w5 w6 w7", "w9 w10"], "parameters": {"num_beams": 2, "max_new_tokens": 6}}
        response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    tokenizer = bart_server.tokenizer
    for text, result in zip(body["inputs"], results, strict=True):
        ids = tokenizer(text)["input_ids"]
        expected, _ = oracle(bart_server.model, ids, body["parameters"], None)
        row = result["sequences"][0]
        assert row["token_ids"] == expected[0]
        assert row["text"] == tokenizer.decode(expected[0][1:], skip_special_tokens=True)
        assert set(result["timings"]) == {"queued_s", "first_step_s", "total_s"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [5, 6], "parameters": {"num_beams": 0}}, "num_beams must be >= 1"),
        ({"input_ids": [5, 6], "parameters": {"num_beams": "4"}}, "num_beams must be an integer"),
        ({"input_ids": [5, 6], "parameters": {"typical_p": 0.5}}, "unknown parameter 'typical_p'"),
        ({"input_ids": [5, 6], "parameters": {"max_new_tokens": 100000}}, "over this server's limit"),
        ({"input_ids": [5, 1000]}, "outside the vocabulary"),
        ({"input_ids": []}, "input_ids must be"),
        ({"input_ids": list(range(3, 90)) * 2}, "this server takes at most 128"),
        ({"input_ids": [5], "parameters": {"max_new_tokens": 200}}, "over the model's 128 positions"),
        ({"inputs": "w5", "input_ids": [5]}, "either inputs"),
        ({"input_ids": [5], "stream": True}, "unknown field 'stream'"),
        ({"input_ids": [5], "parameters": {"do_sample": True, "num_beams": 2}}, "beam sampling"),
        ({"input_ids": [5], "parameters": {"num_beams": 2, "num_return_sequences": 3}}, "num_return_sequences` (3)"),
    ],
)
def test_bad_requests_are_4xx_with_one_message(bart_server, body, message):
    with httpx.Client(base_url=bart_server.url, timeout=30) as client:
        response = client.post("/v1/generate", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_bad_json_health_models_metrics(gpt2_server):
    with httpx.Client(base_url=gpt2_server.url, timeout=30) as client:
        bad = client.post("/v1/generate", content=b"{not json")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert client.post("/v1/generate", json=[1, 2]).status_code == 400
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert client.post("/v1/generate", json={"input_ids": [4, 5], "parameters": {"max_new_tokens": 3}}).is_success
        text = client.get("/metrics").text
    for name in (
        "fastgen_queue_depth",
        "fastgen_rows_in_flight",
        "fastgen_generated_tokens_total",
        "fastgen_steps_total",
        "fastgen_busy_seconds_total",
        "fastgen_request_latency_seconds_bucket",
        "fastgen_time_to_first_token_seconds_bucket",
        'fastgen_requests_total{endpoint="generate",status="400"}',
    ):
        assert name in text, name


def test_parameters_resolved_once_per_distinct_parameters(bart_server, monkeypatch):
    """Resolving a request's settings walks the model; the app does it once per distinct parameters. A refused
    combination is refused every time, and equal parameters get equal results."""
    from fastgen.serve import app

    calls, original = [], app.settings_for
    monkeypatch.setattr(app, "settings_for", lambda *args: calls.append(args[1]) or original(*args))
    bart_server.app.state.served.resolved.clear()
    body = {"input_ids": [5, 6, 7], "parameters": {"num_beams": 2, "max_new_tokens": 7}}
    refused = {"input_ids": [5], "parameters": {"num_beams": 2, "num_return_sequences": 3}}
    with httpx.Client(base_url=bart_server.url, timeout=60) as client:
        first, second = client.post("/v1/generate", json=body), client.post("/v1/generate", json=body)
        other = client.post("/v1/generate", json={"input_ids": [5, 6, 7], "parameters": {"max_new_tokens": 7}})
        statuses = [client.post("/v1/generate", json=refused).status_code for _ in range(2)]
    assert first.status_code == second.status_code == other.status_code == 200
    assert first.json()["results"][0]["sequences"] == second.json()["results"][0]["sequences"]
    assert statuses == [400, 400]
    assert len(calls) == 4  # body once, the other parameters once, the refused ones each time


def test_startup_objects_are_frozen_while_serving():
    """What exists when the server starts is out of the garbage collector's full passes while it serves (they
    scanned the model and every imported library each time); stopping gives back the freeze it found."""
    before = gc.get_freeze_count()
    with serving(bart(), word_tokenizer(True), batch_rows=8) as running:
        assert gc.get_freeze_count() > before
        body = {"inputs": ["w5 w6"], "parameters": {"max_new_tokens": 3}}
        assert httpx.post(f"{running.url}/v1/generate", json=body, timeout=30).status_code == 200
    if not before:  # no other server of this process froze anything
        assert gc.get_freeze_count() == 0
