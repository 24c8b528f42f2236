"""Where settings come from: request > server flags / YAML > the model's generation_config > built-ins.
Also chat templates (override file, fallback, template kwargs), the reasoning split and request logging."""

import logging
from types import SimpleNamespace

import pytest

from server_utils import LiveServer, tiny_engine
from shoal.cli import build_parser, exposure_warning, model_specs, serve_values, server_settings
from shoal.server import ServerSettings
from shoal.server.chat.params import resolve_params
from shoal.server.openai.protocol import ChatCompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- precedence, unit level


def _resolve(request: dict, settings: ServerSettings, model_defaults: dict, default_max_tokens=None):
    req = ChatCompletionRequest(messages=CHAT, **request)
    state = SimpleNamespace(settings=settings, generation_defaults=model_defaults)
    return resolve_params(req, state, max_tokens=req.max_tokens, default_max_tokens=default_max_tokens, logprobs=None)


def test_each_field_comes_from_the_first_level_that_sets_it():
    settings = ServerSettings(temperature=0.5, top_k=7, max_tokens=30, ignore_eos=True, stop=("END",))
    model = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
    p = _resolve({}, settings, model)
    assert p.temperature == 0.5  # server over model
    assert p.top_k == 7  # server over model
    assert p.top_p == 0.9 and p.repetition_penalty == 1.1  # model over built-in
    assert p.min_p == 0.0 and p.presence_penalty == 0.0  # built-in
    assert p.max_tokens == 30 and p.ignore_eos is True and p.stop == ("END",)

    p = _resolve({"temperature": 0.0, "top_p": 0.5, "max_tokens": 4, "ignore_eos": False, "stop": []}, settings, model)
    assert (p.temperature, p.top_p, p.max_tokens, p.ignore_eos, p.stop) == (0.0, 0.5, 4, False, ())


def test_a_json_reply_takes_a_frequency_penalty_unless_a_level_sets_one():
    from shoal.server.chat.params import JSON_FREQUENCY_PENALTY
    from shoal.types import StructuredOutput

    schema, other = StructuredOutput(json_schema='{"type": "object"}'), StructuredOutput(regex="[a-z]+")

    def penalty(request, settings=ServerSettings(), model=None, structured=schema, tool_call=False):
        req = ChatCompletionRequest(messages=CHAT, **request)
        state = SimpleNamespace(settings=settings, generation_defaults=model or {})
        return resolve_params(req, state, max_tokens=None, default_max_tokens=None, logprobs=None, structured=structured,
                              tool_call=tool_call).frequency_penalty

    assert JSON_FREQUENCY_PENALTY == 0.5
    assert penalty({}) == 0.5
    assert penalty({}, structured=StructuredOutput(json_object=True)) == 0.5
    assert penalty({"frequency_penalty": 0.0}) == 0.0  # the request's own value, zero included
    assert penalty({}, settings=ServerSettings(frequency_penalty=0.0)) == 0.0  # the server's
    assert penalty({}, model={"frequency_penalty": 0.2}) == 0.2  # the model's
    assert penalty({}, tool_call=True) == 0.0  # a forced tool call is not a JSON reply the client asked for
    assert penalty({}, structured=other) == 0.0 and penalty({}, structured=None) == 0.0


def test_unset_everywhere_gives_the_built_in_defaults():
    p = _resolve({}, ServerSettings(), {}, default_max_tokens=16)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.ignore_eos, p.n, p.seed) == (1.0, 1.0, 0, 16, False, 1, None)


def test_request_schemas_default_every_optional_field_to_none():
    req = ChatCompletionRequest(messages=CHAT)
    unset = {k: v for k, v in req.model_dump().items() if k != "messages"}
    assert all(v is None for v in unset.values()), {k: v for k, v in unset.items() if v is not None}


# ---------------------------------------------------------------- precedence, over HTTP


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return tiny_engine(tiny_llama_path)


def test_server_defaults_apply_unless_the_request_says_otherwise(engine):
    settings = ServerSettings(max_tokens=3, ignore_eos=True, temperature=0.0, log_requests=False)
    with LiveServer(engine, settings) as srv:
        client = srv.openai()
        r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, max_tokens=5)
        assert r.usage.completion_tokens == 5
        # The model's generation_config (temperature 0.7 for the tiny model) is under the server's 0.0: greedy.
        texts = {client.completions.create(model=srv.state.model_name, prompt="a b", max_tokens=6).choices[0].text for _ in range(3)}
        assert len(texts) == 1


def test_yaml_config_with_flags_winning(tmp_path, monkeypatch):
    cfg = tmp_path / "shoal.yaml"
    cfg.write_text(
        "model: /models/x\nport: 9001\nmax-model-len: 256\ntemperature: 0.3\nstop: END\n"
        "served_model_name: from-yaml\nkv-cache-memory: 64MiB\nallowed-origins: [http://a.example]\nlog-level: debug\n"
    )
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    a = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "9002", "--served-model-name", "from-flag", "--max-tokens", "7"])
    v = serve_values(a)
    assert v["port"] == 9002 and v["served_model_name"] == "from-flag"  # flags win
    assert v["max_model_len"] == 256 and v["temperature"] == 0.3 and v["log_level"] == "debug"  # from the file
    assert v["host"] == "127.0.0.1" and v["block_size"] == 16  # defaults
    s = server_settings(v)
    assert (s.port, s.temperature, s.max_tokens, s.stop, s.allowed_origins, s.api_key) == (
        9002, 0.3, 7, ("END",), ("http://a.example",), "from-env")
    (spec,) = model_specs(v)
    e = spec.config
    assert (spec.name, e.model, e.max_model_len, e.cache.kv_cache_memory) == ("from-flag", "/models/x", 256, 64 << 20)
    cfg.write_text("api-key: from-yaml\n")
    assert serve_values(build_parser().parse_args(["serve", "--config", str(cfg)]))["api_key"] == "from-yaml"
    assert serve_values(build_parser().parse_args(["serve", "--config", str(cfg), "--api-key", "k"]))["api_key"] == "k"


def test_request_bounds_from_flags_and_yaml(tmp_path):
    s = server_settings(serve_values(build_parser().parse_args(["serve"])))
    assert (s.max_sequences_per_request, s.max_request_bytes) == (128, None)  # None: fit the model's context
    cfg = tmp_path / "shoal.yaml"
    cfg.write_text("max-sequences-per-request: 16\nmax_request_bytes: 2MiB\n")
    s = server_settings(serve_values(build_parser().parse_args(["serve", "--config", str(cfg)])))
    assert (s.max_sequences_per_request, s.max_request_bytes) == (16, 2 << 20)
    a = build_parser().parse_args(["serve", "--config", str(cfg), "--max-sequences-per-request", "4", "--max-request-bytes", "auto"])
    s = server_settings(serve_values(a))
    assert (s.max_sequences_per_request, s.max_request_bytes) == (4, None)
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        server_settings(serve_values(build_parser().parse_args(["serve", "--max-sequences-per-request", "0"])))


def test_yaml_config_errors_are_readable(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown key 'prot'"):
        serve_values(build_parser().parse_args(["serve", "--config", str(cfg)]))
    with pytest.raises(ValueError, match="does not exist"):
        serve_values(build_parser().parse_args(["serve", "--config", str(tmp_path / "none.yaml")]))



@pytest.mark.parametrize("line, message", [
    ("max-waiting: ten", "'max-waiting' in .*: 'ten' is not a valid int"),
    ("max-waiting: [1, 2]", "'max-waiting' in .* takes one value, not a list"),
    ("log-format: xml", "'log-format' in .* must be one of text, json, not 'xml'"),
    ("dtype: float64", "'dtype' in .* must be one of .*, not 'float64'"),
    ("metrics-public: yes please", "'metrics-public' in .* must be true or false"),
    ("temperature: true", "'temperature' in .*: True is not a valid float"),
    ("log-level: loud", "'log-level' in .* must be one of debug, info, warning, error"),
    ("port:", "'port' in .*: None is not a valid int"),  # null only where the flag's default is None
    ("models: [{model: a, max-model-len: abc}]", "'max-model-len' of models\\[0\\] in .*: 'abc' is not a valid auto_int"),
])
def test_yaml_values_are_checked_as_their_flags_are(tmp_path, line, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        serve_values(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert "\n" not in str(e.value) and "pydantic" not in str(e.value)  # one line, not the validator's report


def test_yaml_values_take_their_flags_types(tmp_path):
    cfg = tmp_path / "shoal.yaml"
    cfg.write_text('max-waiting: "10"\ntemperature: 0\nstop: END\nallowed-origins: [https://a.example, https://b.example]\n')
    v = serve_values(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert (v["max_waiting"], v["temperature"], v["stop"]) == (10, 0.0, ["END"])
    assert v["allowed_origins"] == ["https://a.example", "https://b.example"]
    assert type(v["temperature"]) is float


# ---------------------------------------------------------------- chat templates


def test_chat_template_file_and_template_kwargs(engine, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% if enable_thinking %} <think>{% endif %}{% endif %}"
    )
    settings = ServerSettings(chat_template=template, log_requests=False)
    with LiveServer(engine, settings) as srv, srv.http() as h:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        plain = h.post("/tokenize", json={"messages": messages}).json()["prompt"]
        assert plain == "[system] Be brief.\n[user] hi\n[assistant]"
        thinking = h.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}).json()
        assert thinking["prompt"].endswith("[assistant] <think>")
        r = srv.openai().chat.completions.create(model=srv.state.model_name, messages=messages, max_tokens=2,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.usage.prompt_tokens == thinking["count"]


def test_models_without_a_template_get_the_plain_fallback(tiny_llama_path):
    engine = tiny_engine(tiny_llama_path)
    engine.tokenizer.chat_template = None
    with LiveServer(engine) as srv, srv.http() as h:
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
        prompt = h.post("/tokenize", json={"messages": messages}).json()["prompt"]
        assert prompt == "S\n\nUser: hi\nAssistant: hello\nUser: bye\nAssistant:"
        r = h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        assert r.status_code == 200


def test_reasoning_parser_moves_unclosed_thinking_into_reasoning_content(engine):
    # The random model never writes </think>, so with deepseek_r1 all of its text is reasoning.
    params = dict(messages=CHAT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    with LiveServer(engine) as srv:
        plain = srv.openai().chat.completions.create(model=srv.state.model_name, **params).choices[0].message.content
    with LiveServer(engine, ServerSettings(reasoning_parser="deepseek_r1", log_requests=False)) as srv:
        client = srv.openai()
        msg = client.chat.completions.create(model=srv.state.model_name, **params).choices[0].message
        assert msg.content == "" and msg.model_extra["reasoning_content"] == plain
        streamed = "".join(
            (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for ch in client.chat.completions.create(model=srv.state.model_name, stream=True, **params) if ch.choices
        )
        assert streamed == plain


# ---------------------------------------------------------------- logging


def test_one_log_line_per_request_and_prompts_at_debug(engine, caplog):
    with LiveServer(engine, ServerSettings(log_requests=True)) as srv:
        with caplog.at_level(logging.DEBUG, logger="shoal.server"):
            r = srv.openai().chat.completions.create(model=srv.state.model_name, messages=CHAT, max_tokens=3,
                                                     extra_body={"ignore_eos": True})
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "shoal.server" and r.id in rec.getMessage()]
    info = [ln for ln in lines if "completion=" in ln]
    assert len(info) == 1
    for part in (f"model={srv.state.model_name}", f"prompt={r.usage.prompt_tokens}", "cached=", "completion=3", "ttft=", "tok/s", "finish=length"):
        assert part in info[0], (part, info[0])
    assert any("prompt token ids" in ln for ln in lines) and any("rendered prompt" in ln and "<|im_start|>" in ln for ln in lines)


def test_a_keyless_server_beyond_loopback_is_warned_about():
    def settings(*flags):
        return server_settings(serve_values(build_parser().parse_args(["serve", *flags])))

    assert exposure_warning(settings()) is None  # 127.0.0.1
    assert exposure_warning(settings("--host", "localhost")) is None
    assert exposure_warning(settings("--host", "0.0.0.0", "--api-key", "k")) is None
    assert "0.0.0.0 without --api-key" in exposure_warning(settings("--host", "0.0.0.0"))
    assert "without --api-key" in exposure_warning(settings("--host", "192.0.2.7"))
