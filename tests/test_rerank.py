"""Reranking with a cross-encoder (issue 55): a tiny random BertForSequenceClassification folder in
sentence-transformers' CrossEncoder layout, its scores against CrossEncoder.predict, and POST /v1/rerank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server_utils import LiveServer, tiny_engine, tiny_engine_config
from shoal.types import GenerationRequest, PoolingParams, SamplingParams
from test_embeddings import make_tiny_bert, max_diff, perturb_norms_and_biases, run_pooled
from tiny_models import make_tiny_model

QUERY = "what does the fox eat"
DOCS = ["the quick brown fox jumps over the lazy dog", "hello world", "def add(x, y):\n    return x + y\n" * 4,
        "a fox eats mice and berries", "b"]


def make_tiny_cross_encoder(path: Path, seed: int = 0, num_labels: int = 1) -> Path:
    """The tiny BERT's folder with a BertForSequenceClassification (pooler and classifier) in place of its BertModel."""
    import transformers

    make_tiny_bert(path, seed=seed)
    config = transformers.AutoConfig.from_pretrained(path)
    config.num_labels = num_labels
    config.architectures = ["BertForSequenceClassification"]
    config.initializer_range = 0.3  # at 0.02 a random BERT's [CLS] row hardly depends on its input: every score alike
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    perturb_norms_and_biases(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    return make_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"), seed=7)


@pytest.fixture(scope="module")
def reference(cross_encoder):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(cross_encoder), device="cpu")
    return ce, [float(x) for x in ce.predict([(QUERY, d) for d in DOCS], batch_size=1)]


def scores(engine, pairs, prefix="s") -> list[float]:
    """Each token list's score, all added at once (one batch), through the engine's step loop."""
    return [out[0] for out in run_pooled(engine, pairs, PoolingParams("score", False), prefix)]


def test_scores_equal_sentence_transformers_cross_encoder_alone_and_in_a_batch(cross_encoder, reference):
    ce, want = reference
    assert type(ce.activation_fn).__name__ == "Sigmoid"  # CrossEncoder's default for one label
    assert max(want) - min(want) > 0.1  # the documents score apart
    engine = tiny_engine(cross_encoder, check_integrity=True)
    assert engine.pooling.mode == "score" and engine.prefix_cache is None
    pairs = [ce.tokenizer(QUERY, d)["input_ids"] for d in DOCS]
    types = ce.tokenizer(QUERY, DOCS[0])["token_type_ids"]
    assert 0 in types and 1 in types  # a pair: segment 1 matters
    together = scores(engine, pairs, prefix="batch")
    for i, (got, w) in enumerate(zip(together, want)):
        assert abs(got - w) < 1e-5
        assert scores(engine, [pairs[i]], prefix=f"alone{i}-")[0] == got  # alone, bitwise: each pair runs unpadded
    assert engine.pool.num_free == engine.runner.num_blocks  # no KV: every block back


def test_segment_ids_reach_the_encoder(cross_encoder, reference):
    """Scored with every segment id 0, the pairs would score otherwise: the runner gives the document segment 1."""
    import transformers

    ce, want = reference
    model = transformers.AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    enc = ce.tokenizer(QUERY, DOCS[0], return_tensors="pt")
    with torch.no_grad():
        flat = torch.sigmoid(model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits)[0, 0].item()
    assert abs(flat - want[0]) > 1e-4
    assert abs(scores(tiny_engine(cross_encoder), [enc["input_ids"][0].tolist()])[0] - want[0]) < 1e-5


def test_an_identity_activation_in_the_config_gives_raw_logits(tmp_path):
    import json

    from sentence_transformers import CrossEncoder

    path = make_tiny_cross_encoder(tmp_path / "ce", seed=8)
    config = json.loads((path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(config))
    ce = CrossEncoder(str(path), device="cpu")
    want = [float(x) for x in ce.predict([(QUERY, d) for d in DOCS[:2]])]
    assert any(x < 0 or x > 1 for x in want)  # logits, not probabilities
    got = scores(tiny_engine(path), [ce.tokenizer(QUERY, d)["input_ids"] for d in DOCS[:2]])
    assert max_diff(got, want) < 1e-5


# ---------------------------------------------------------------- the HTTP route


@pytest.fixture(scope="module")
def server(cross_encoder):
    with LiveServer(tiny_engine_config(cross_encoder)) as srv:
        yield srv


def test_rerank_sorts_cuts_to_top_n_and_returns_documents(server, reference):
    _, want = reference
    r = server.http().post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == server.openai().models.list().data[0].id and body["id"]
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
        assert x["document"] == {"text": DOCS[x["index"]]}
    tokenizer = server.engine.tokenizer
    assert body["usage"]["total_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCS)

    r = server.http().post("/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                               "return_documents": False})
    assert r.status_code == 200, r.text
    cut = r.json()["results"]
    assert [x["index"] for x in cut] == [x["index"] for x in results[:2]]
    assert all("document" not in x for x in cut)


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank", "/v1/reranking", "/reranking"])
def test_llama_cpp_s_and_vllm_s_routes_answer_the_same(server, reference, path):
    _, want = reference
    r = server.http().post(path, json={"query": QUERY, "documents": DOCS[:2], "top_n": 1})
    assert r.status_code == 200, r.text
    (only,) = r.json()["results"]
    assert only["index"] == max(range(2), key=lambda i: want[i])


@pytest.mark.parametrize("body, param", [
    ({"documents": ["a"]}, "query"),
    ({"query": 3, "documents": ["a"]}, "query"),
    ({"query": "", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q"}, "documents"),
    ({"query": "q", "documents": "a"}, "documents"),
    ({"query": "q", "documents": ["a", 3]}, "documents"),
    ({"query": "q", "documents": [{"title": "a"}]}, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ({"query": "q [SEP] r", "documents": ["a"]}, "query"),
    ({"query": "q", "documents": ["a " * 200]}, "documents"),
])
def test_bad_input_is_a_400_naming_its_param_and_the_server_goes_on(server, body, param):
    r = server.http().post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = server.http().post("/v1/rerank", json={"query": "q", "documents": ["a"]})
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1


def test_a_wrongly_typed_field_and_an_unknown_model_are_4xx(server):
    r = server.http().post("/v1/rerank", json={"query": "q", "documents": ["a"], "top_n": "2"})
    assert 400 <= r.status_code < 500 and "error" in r.json()
    r = server.http().post("/v1/rerank", json={"model": "no-such-model", "query": "q", "documents": ["a"]})
    assert r.status_code in (400, 404) and r.json()["error"]["message"]
    r = server.http().post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "/v1/rerank" in r.json()["error"]["message"]
    assert server.http().post("/v1/rerank", json={"query": "q", "documents": ["a"]}).status_code == 200


def test_a_model_that_cannot_rerank_is_a_400_naming_model(tmp_path):
    path = make_tiny_bert(tmp_path / "bert")
    with LiveServer(tiny_engine_config(path, embeddings=True)) as srv:
        r = srv.http().post("/v1/rerank", json={"query": "q", "documents": ["a", "b"]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "cross-encoder" in err["message"]
        assert srv.http().post("/v1/embeddings", json={"input": "hello"}).status_code == 200  # the server goes on


def test_a_decoder_cannot_rerank(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama", seed=1)
    with LiveServer(tiny_engine_config(path)) as srv:
        r = srv.http().post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert srv.http().post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_the_engine_refuses_a_pooling_mode_its_model_does_not_pool_by(cross_encoder, tmp_path):
    """The engine's own check, for callers that skip the server: a cross-encoder scores, an embedder embeds."""
    engine = tiny_engine(cross_encoder)
    for mode in ("mean", "last", "cls"):
        with pytest.raises(ValueError, match=f"this model pools by 'score', not '{mode}'"):
            engine.validate(GenerationRequest("x", (5, 6, 7), SamplingParams(), pooling=PoolingParams(mode)))
    embedder = tiny_engine(make_tiny_bert(tmp_path / "bert"), embeddings=True)
    with pytest.raises(ValueError, match=r"this model pools by '\w+', not 'score'"):
        embedder.validate(GenerationRequest("y", (5, 6, 7), SamplingParams(), pooling=PoolingParams("score", normalize=False)))


def test_the_guide_s_rerank_snippets_run_against_a_live_server(server):
    """docs/guides/embeddings.md's reranking snippets, as written but for the address and model name."""
    from test_embeddings import guide_blocks

    blocks = [(lang, code) for lang, code in guide_blocks() if "/rerank" in code and (lang == "python" or "curl" in code)]
    assert sorted(lang for lang, _ in blocks) == ["python", "sh"]
    name = server.openai().models.list().data[0].id
    for lang, code in blocks:
        code = code.replace("http://127.0.0.1:8000", server.url).replace("ms-marco-MiniLM-L-6-v2", name)
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_PROXY": "*"})
        assert run.returncode == 0, (code, run.stderr[-2000:])
        assert '"results"' in run.stdout if lang == "sh" else len(run.stdout.strip().splitlines()) == 2, run.stdout


def test_a_classifier_of_several_labels_does_not_rerank(tmp_path):
    path = make_tiny_cross_encoder(tmp_path / "ce3", seed=9, num_labels=3)
    with LiveServer(tiny_engine_config(path)) as srv:
        r = srv.http().post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "3 labels" in err["message"]


def test_metrics_carry_the_openai_rerank_protocol(server):
    import re

    assert server.http().post("/v1/rerank", json={"query": "count me", "documents": ["a", "b"]}).status_code == 200
    text = server.http().get("/metrics").text
    assert re.search(r'shoal:e2e_request_latency_seconds_count\{[^}]*protocol="openai_rerank"[^}]*\} [1-9]', text)
