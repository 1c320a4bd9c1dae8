"""The Ray Serve deployment (fastgen/serve/ray_serve.py) on a local Ray instance: a tiny model saved to disk,
deployed as ``serve run`` would deploy it, asked over HTTP on 127.0.0.1; the answer is upstream ``generate``'s."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

import fastgen
from tests import harness
from tests.serve.conftest import free_port, word_tokenizer

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from fastgen.serve.ray_serve import app_builder  # noqa: E402  (needs ray)


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch):
    """A one-CPU Ray instance with Serve's proxy on a free port of 127.0.0.1; its URL."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_deployment_answers_what_generate_returns(local_ray, tmp_path):
    harness.tiny_hf_model("gpt2").save_pretrained(tmp_path)
    word_tokenizer(False).save_pretrained(tmp_path)
    serve.run(app_builder({"argv": f"{tmp_path} --threads 1 --name tiny"}), name="fastgen", route_prefix="/")

    prompt = [5, 17, 9, 33]
    params = {"num_beams": 3, "max_new_tokens": 6}
    response = httpx.post(f"{local_ray}/v1/generate", json={"input_ids": prompt, "parameters": params}, timeout=60)
    assert response.status_code == 200, response.text
    (sequence,) = response.json()["results"][0]["sequences"]

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([prompt])
    with fastgen.unpatched(), torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **params)
    assert sequence["token_ids"] == expected[0].tolist()
    assert httpx.get(f"{local_ray}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"
