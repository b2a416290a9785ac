"""Images in chat through the OpenAI API: the official `openai` client against the in-process
ingress (tests/deployments/local_ingress.py) over the real engine on the tiny checkpoint with
its vision tower; bad images each get a 400 envelope and the server stays healthy."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from glm53.deployments.config import ImageConfig, ServingConfig
from tests.deployments.local_ingress import local_ingress, served_over_http

MODEL = "tiny-vision"


def png(width: int = 64, height: int = 48, seed: int = 0, fmt: str = "PNG") -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(data).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def ask(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def base_url(tiny_checkpoint):
    config = ServingConfig(served_model_name=MODEL, model=str(tiny_checkpoint), device="cpu",
                           speculative="none", vision=True, num_blocks=256, max_model_len=1024,
                           images=ImageConfig(max_images=2, max_bytes=60_000))
    with pytest.MonkeyPatch.context() as mp:
        app = local_ingress(mp, config=config, engine_factory=None)
        with served_over_http(app) as url:
            yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_openai_client_sends_a_base64_image(client, base_url):
    image = data_url(png())
    # ignore_eos (our extension, as vLLM's): the random tiny model may end early otherwise
    greedy = dict(max_tokens=4, temperature=0, reasoning_effort="none",
                  extra_body={"ignore_eos": True})
    answer = client.chat.completions.create(model=MODEL, messages=ask(image), **greedy)
    text_only = client.chat.completions.create(model=MODEL, messages=ask(), **greedy)
    assert answer.choices[0].message.content is not None
    assert answer.usage.completion_tokens == 4
    # a 64x48 image is enlarged past the minimum of 16 tokens, to 112x140 pixels: 4x5 merged
    # tokens, which usage counts (its one placeholder becomes 20; the start/end markers add 2)
    assert answer.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + 20
    again = client.chat.completions.create(model=MODEL, messages=ask(image), **greedy)
    assert again.choices[0].message.content == answer.choices[0].message.content


BAD = {  # messages, and a fragment of the error message
    "corrupt bytes": (ask(data_url(b"\x89PNG\r\n\x1a\n broken")), "cannot decode"),
    "not base64": (ask("data:image/png;base64,@@@@"), "base64"),
    "unsupported type": (ask(data_url(png(fmt="TIFF"), "image/tiff")), "supported: PNG"),
    "not an image media type": (ask(data_url(b"hello", "text/plain")), "not an image"),
    "too large": (ask(data_url(png(400, 400))), "larger than 60000 bytes"),  # ~480 KB
    "too many": (ask(*[data_url(png(seed=i)) for i in range(3)]), "3 images; at most 2"),
    "remote url while fetching is off": (ask("https://example.com/cat.png"),
                                         "does not fetch image URLs"),
    "file path": (ask("file:///etc/passwd"), "unsupported image URL scheme 'file'"),
    "malformed part": ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                       "image content part"),
}


@pytest.mark.parametrize(("messages", "fragment"), BAD.values(), ids=BAD.keys())
def test_bad_images_get_a_400_envelope(base_url, messages, fragment):
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def test_text_only_deployment_refuses_images(monkeypatch):
    app = local_ingress(monkeypatch)  # the scripted engine, no vision
    with served_over_http(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "scripted", "messages": ask(data_url(png())), "max_tokens": 2})
    assert r.status_code == 400
    assert "vision" in r.json()["error"]["message"]


def test_serve_vision_runs_the_embedded_model_with_its_tower(monkeypatch, tmp_path):
    """`glm53 serve --vision` with no model: the embedded tiny checkpoint has a vision tower
    (served with the default profile's MTP drafts); `--image-urls` turns fetching on."""
    from glm53.deployments.cli import _parser
    from glm53.deployments.serve_cli import serving_config

    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    config = serving_config(_parser().parse_args(["serve", "--vision", "--num-blocks", "128"]))
    assert config.vision and config.model is None and not config.images.fetch_urls
    assert serving_config(_parser().parse_args(
        ["serve", "--vision", "--image-urls"])).images.fetch_urls
    app = local_ingress(monkeypatch, config=config, engine_factory=None)
    with served_over_http(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": config.model_name, "messages": ask(data_url(png())), "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    embedded = next(tmp_path.glob("tiny-v*"))
    assert sum(f.stat().st_size for f in embedded.iterdir()) < 4 << 20  # stays small


@pytest.mark.slow  # two engines, DFlash drafting on CPU: about a minute
def test_mm_dflash2_profile_serves_images_with_the_tiny_draft(monkeypatch, tmp_path,
                                                              tiny_checkpoint):
    """The multimodal profile end to end: vision on, DFlash2 drafts from a tiny draft made for
    the checkpoint; a greedy answer about an image equals the one without speculation."""
    from glm53.raycluster.api import read_config, write_tiny_draft

    draft = write_tiny_draft(tmp_path / "draft", read_config(tiny_checkpoint))
    answers = []
    for speculative in ({"method": "dflash", "draft_model": str(draft)}, "none"):
        config = ServingConfig(profile="mm-dflash2", model=str(tiny_checkpoint), device="cpu",
                               served_model_name=MODEL, num_blocks=256, max_model_len=1024,
                               speculative=speculative)
        app = local_ingress(monkeypatch, config=config, engine_factory=None)
        with served_over_http(app) as url:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": MODEL, "messages": ask(data_url(png())), "max_tokens": 12,
                "temperature": 0})
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"])
    assert answers[0] == answers[1]
