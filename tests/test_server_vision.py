"""Images through the HTTP APIs: the openai and anthropic SDKs as clients of a live server with a tiny Qwen2-VL.

- The same picture sent as an OpenAI data: URI, an Anthropic base64 block, an allowed URL and a file gives
  the same greedy reply, and after the first the prefix cache holds its tokens (the tower ran once).
- /tokenize and count_tokens count an image as its tokens; /v1/models says the model takes images.
- Bad images are 400s that name the problem, while another stream keeps going; fetching is off by default,
  and a URL that names a loopback address is refused without --allow-private-media-addresses.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading

import anthropic
import pytest
from PIL import Image

from shoal.server import ServerSettings
from server_utils import LiveServer, tiny_engine
from test_vision import picture
from tiny_models import make_tiny_vl_model

KEY = "vision-key"


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PICTURE = picture(150, 100, 21)
PNG = png_bytes(PICTURE)


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path == "/away":  # a redirect to a host name the allowlist does not hold
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, image_host):
    path = make_tiny_vl_model("qwen2_vl", tmp_path_factory.mktemp("vl_server"))
    files = tmp_path_factory.mktemp("media")
    (files / "cat.png").write_bytes(PNG)
    settings = ServerSettings(api_key=KEY, log_requests=False, allowed_media_domains=("127.0.0.1",),
                              allow_private_media_addresses=True, allowed_local_media_path=files)
    engine = tiny_engine(path, attention="invariant", max_model_len=256, num_blocks=128, block_size=4)
    with LiveServer(engine, settings) as s:
        s.files = files
        yield s


def ask_openai(srv, url: str, **kw) -> tuple[str, int]:
    r = srv.openai(api_key=KEY).chat.completions.create(
        model=srv.state.model_name, temperature=0, max_tokens=6,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image_url", "image_url": {"url": url, **kw}}]}],
    )
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_one_picture_by_every_route_gives_one_answer_and_is_encoded_once(srv, image_host):
    encoder = srv.engine.runner.encoder
    before = encoder.stats.images_encoded
    first, prompt_tokens = ask_openai(srv, data_uri(PNG))
    assert encoder.stats.images_encoded == before + 1
    cached_before = srv.engine.stats.cached_prompt_tokens
    assert ask_openai(srv, data_uri(png_bytes(PICTURE, "WEBP"), "image/webp"))[0] == first  # the same pixels, as WebP
    assert ask_openai(srv, f"{image_host}/cat.png")[0] == first
    assert ask_openai(srv, (srv.files / "cat.png").as_uri())[0] == first
    # The tower never ran again, and the later requests took the image's tokens from the prefix cache.
    assert encoder.stats.images_encoded == before + 1
    assert srv.engine.stats.cached_prompt_tokens - cached_before >= 3 * (prompt_tokens - 8)
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)
    msg = client.messages.create(
        model=srv.state.model_name, max_tokens=6, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}},
        ]}],  # noqa
    )
    # The same conversation as the OpenAI requests' (text, then the image), most of it from the prefix cache.
    assert msg.usage.input_tokens == prompt_tokens and msg.usage.cache_read_input_tokens >= prompt_tokens - 4
    url_msg = client.messages.create(
        model=srv.state.model_name, max_tokens=6, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image", "source": {"type": "url", "url": f"{image_host}/cat.png"}}]}],
    )
    assert url_msg.content[0].text == msg.content[0].text
    assert encoder.stats.images_encoded == before + 1


def test_an_image_in_a_tool_result_reaches_the_model(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)
    messages = [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "here it is"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}}]}]},
    ]
    tools = [{"name": "screenshot", "input_schema": {"type": "object"}}]
    with_image = client.messages.count_tokens(model=srv.state.model_name, messages=messages, tools=tools).input_tokens
    messages[2]["content"][0]["content"] = "here it is"
    without = client.messages.count_tokens(model=srv.state.model_name, messages=messages, tools=tools).input_tokens
    tokens = srv.engine.vision.prepare(PICTURE, b"", None).length
    assert with_image == without + tokens + 2  # the image's tokens, between its start and end markers


def test_tokenize_counts_image_tokens_and_models_say_images(srv):
    with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": data_uri(PNG)}}]
        with_image = h.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
        text_only = h.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        tokens = srv.engine.vision.prepare(PICTURE, b"", None).length
        assert with_image["count"] == text_only["count"] + tokens + 2
        low = h.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(png_bytes(picture(900, 700))), "detail": "low"}}]}]}).json()
        high = h.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(png_bytes(picture(900, 700))), "detail": "high"}}]}]}).json()
        assert low["count"] <= high["count"]
        card = h.get(f"/v1/models/{srv.state.model_name}").json()
        assert card["modalities"]["input"] == ["text", "image"]


def bomb() -> bytes:
    """A PNG whose header says 20000 x 20000 pixels: a few kilobytes that would decode to 1.2 GB."""
    return png_bytes(Image.new("1", (20000, 20000)))


BAD = [
    (lambda host: "data:image/png;base64,not base64!", "base64"),
    (lambda host: data_uri(b"plain text, not an image"), "PNG, JPEG, WebP or GIF"),
    (lambda host: data_uri(PNG[: len(PNG) // 2]), "truncated"),
    (lambda host: data_uri(bomb()), "pixels"),
    (lambda host: data_uri(PNG, "image/jpeg"), "image/jpeg"),
    (lambda host: f"{host}/missing.png", "404"),
    (lambda host: f"{host}/away", "localhost"),
    (lambda host: "https://example.com/cat.png", "example.com"),
    (lambda host: "file:///etc/passwd", "file"),
]


@pytest.mark.parametrize("make_url, words", BAD, ids=[w for _, w in BAD])
def test_bad_images_are_400s_that_name_the_problem(srv, image_host, make_url, words):
    with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        r = h.post("/v1/chat/completions", json={"model": srv.state.model_name, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": make_url(image_host)}}]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert words.lower() in err["message"].lower(), err
        assert err["param"] == "messages[0].content[0]"
        assert "Traceback" not in err["message"] and "/tmp" not in err["message"]


def test_a_stream_keeps_going_while_bad_images_are_refused(srv, image_host):
    client = srv.openai(api_key=KEY)
    stream = client.chat.completions.create(model=srv.state.model_name, max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "count"}])
    pieces = [next(iter(stream))]
    with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        for make_url, _ in BAD:
            r = h.post("/v1/chat/completions", json={"model": srv.state.model_name, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": make_url(image_host)}}]}]})
            assert r.status_code == 400
    pieces.extend(stream)
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"
    assert pieces[-1].usage.completion_tokens == 40


def test_url_fetching_is_off_by_default_and_loopback_needs_its_own_setting(tmp_path, image_host):
    path = make_tiny_vl_model("qwen2_vl", tmp_path / "m")
    engine = tiny_engine(path, max_model_len=256, num_blocks=64, block_size=4)
    body = lambda url: {"model": "m", "max_tokens": 2, "messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with LiveServer(engine, ServerSettings(log_requests=False, served_model_name="m")) as s, s.http() as h:
        r = h.post("/v1/chat/completions", json=body(f"{image_host}/cat.png"))
        assert r.status_code == 400 and "--allowed-media-domains" in r.json()["error"]["message"]
        r = h.post("/v1/chat/completions", json=body(data_uri(PNG)))
        assert r.status_code == 200  # data: URIs need no setting
    engine = tiny_engine(path, max_model_len=256, num_blocks=64, block_size=4)
    allowed = ServerSettings(log_requests=False, served_model_name="m", allowed_media_domains=("127.0.0.1",))
    with LiveServer(engine, allowed) as s, s.http() as h:
        r = h.post("/v1/chat/completions", json=body(f"{image_host}/cat.png"))
        assert r.status_code == 400
        assert "private or loopback" in r.json()["error"]["message"], r.json()


def test_a_text_model_refuses_images_before_fetching_them(tmp_path):
    from tiny_models import make_tiny_model

    engine = tiny_engine(make_tiny_model("qwen2", tmp_path / "t"))
    with LiveServer(engine, ServerSettings(log_requests=False, served_model_name="t")) as s, s.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "t", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]})
        assert r.status_code == 400 and "does not accept images" in r.json()["error"]["message"]
        assert h.get("/v1/models/t").json()["modalities"]["input"] == ["text"]


def test_stats_and_metrics_count_images_and_encoder_work(srv):
    from prometheus_client.parser import text_string_to_metric_families

    fresh = png_bytes(picture(120, 90, 99))
    before = srv.engine.runner.encoder.stats.images_encoded
    for _ in range(2):
        ask_openai(srv, data_uri(fresh))
    encoder = srv.engine.runner.encoder.stats
    assert encoder.images_encoded == before + 1
    with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        srv.wait_until(lambda: h.get("/stats").json()["vision"]["images_encoded"] == encoder.images_encoded, what="/stats")
        stats = h.get("/stats").json()
        metrics = {s.name: s.value for f in text_string_to_metric_families(h.get("/metrics").text) for s in f.samples}
    vision = stats["vision"]
    assert vision["images"] == srv.engine.stats.images
    assert (vision["cache_hits"], vision["cached_images"]) == (encoder.cache_hits, encoder.cached_images)
    assert metrics["shoal:request_images_total"] == srv.engine.stats.images
    assert metrics["shoal:encoder_runs_total"] == encoder.images_encoded
    assert metrics["shoal:encoder_cache_hits_total"] == encoder.cache_hits
    assert metrics["shoal:encoder_cache_bytes"] == encoder.cached_bytes > 0
    assert metrics["shoal:encoder_seconds_total"] > 0


def test_an_idefics3_model_takes_images_through_both_sdks(tmp_path):
    """SmolVLM's architecture: a tile per run of image tokens between row and column markers, a template that takes
    content as parts only. One picture by both SDKs: one answer, its tiles encoded once."""
    path = make_tiny_vl_model("idefics3", tmp_path / "smol")
    engine = tiny_engine(path, attention="invariant", max_model_len=256, num_blocks=128, block_size=4)
    with LiveServer(engine, ServerSettings(log_requests=False, served_model_name="smol")) as s:
        r = s.openai().chat.completions.create(model="smol", temperature=0, max_tokens=5, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_uri(PNG)}}]}])
        msg = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0).messages.create(
            model="smol", max_tokens=5, system="Be brief.", extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}}]}])
        assert msg.content[0].text == r.choices[0].message.content
        assert msg.usage.input_tokens == r.usage.prompt_tokens
        prepared = s.engine.vision.prepare(PICTURE, b"", None)
        assert len(prepared.tiles) == 5 and s.engine.runner.encoder.stats.images_encoded == 5  # 2 x 2 tiles and the global view
        with s.http() as h:
            text_only = h.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "What is this?"}]}).json()["count"]
        assert r.usage.prompt_tokens == text_only + prepared.length


def test_the_tower_runs_on_the_media_threads_not_in_the_engine_step_and_not_for_a_count(srv):
    """A request's images are encoded before it reaches the engine, beside the steps other sequences decode in;
    counting tokens encodes nothing."""
    import threading

    encoder = srv.engine.runner.encoder
    tower, threads = encoder.tower, []

    def recording(pixels):
        threads.append(threading.current_thread().name)
        return tower(pixels)

    encoder.tower = recording
    try:
        fresh = data_uri(png_bytes(picture(140, 84, 123)))
        with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
            h.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": fresh}}]}]})
        assert threads == []
        ask_openai(srv, fresh)
        assert len(threads) == 1 and threads[0].startswith("shoal-media")
    finally:
        encoder.tower = tower


def test_the_responses_style_and_bare_url_image_parts_are_taken(srv):
    with srv.http(headers={"Authorization": f"Bearer {KEY}"}) as h:
        counts = [h.post("/tokenize", json={"messages": [{"role": "user", "content": [part]}]}).json()["count"] for part in (
            {"type": "image_url", "image_url": {"url": data_uri(PNG)}},
            {"type": "image_url", "image_url": data_uri(PNG)},
            {"type": "input_image", "image_url": data_uri(PNG), "detail": "auto"})]
        assert counts[0] == counts[1] == counts[2] > 20
        r = h.post("/tokenize", json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
