"""Broken and hostile model files (model/file_checks.py, the GGUF reader, the safetensors loader): each is refused
with one line that names the file and what is wrong, before anything it claims is allocated, and a server with a
good model beside a bad one keeps serving the good one."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from shoal.model.file_checks import (
    MAX_ARRAY_ENTRIES, Described, ModelFileError, Span, check_config, check_safetensors_header, check_spans, in_words,
)

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------- file_checks' arithmetic


def test_counts_in_words():
    assert [in_words(n) for n in (0, 999, 1_048_576, 1 << 21, (1 << 21) + 1, 1 << 40)] == [
        "0", "999", "1,048,576", "2^21", "2,097,153", "2^40"]


def test_spans_inside_aligned_and_apart():
    check_spans("m.gguf", [Span("a", 32, 64), Span("b", 64, 96), Span("empty", 96, 96)], size=96, alignment=32, base=32)
    cases = [
        ([Span("a", 32, 200)], "m.gguf: truncated: tensor a needs bytes 32–200, the file has 96"),
        ([Span("a", 32, 96), Span("b", 64, 96)], "m.gguf: tensors a and b overlap (bytes 64–96)"),
        ([Span("a", 40, 64)], "m.gguf: tensor a starts at byte 40, not on the file's 32-byte alignment"),
        ([Span("a", 16, 20)], "m.gguf: tensor a has a negative offset or size"),
    ]
    for spans, message in cases:
        with pytest.raises(ModelFileError) as e:
            check_spans("/some/dir/m.gguf", spans, size=96, alignment=32, base=32)
        assert str(e.value) == message


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_safetensors_headers_against_their_length(tmp_path):
    good = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
            "__metadata__": {"format": "pt"}}
    assert check_safetensors_header(_safetensors(tmp_path / "m.safetensors", good, bytes(32))) == {"a": (2, 3), "b": (4,)}
    cases = [
        ({**good, "a": {**good["a"], "shape": [1 << 20, 1 << 20]}}, bytes(32),
         "tensor a: shape [1048576, 1048576] of F32 is 2^42 bytes, but its data_offsets span 24"),
        ({**good, "b": {**good["b"], "data_offsets": [16, 24]}}, bytes(32), "tensors a and b overlap (bytes "),
        (good, bytes(28), "truncated: tensor b needs bytes"),
        ({**good, "a": {**good["a"], "dtype": "Q9"}}, bytes(32), "tensor a has no known dtype"),
        ({**good, "a": {**good["a"], "shape": [-2, 3]}}, bytes(32), "tensor a has a malformed shape [-2, 3]"),
        ({**good, "a": {**good["a"], "data_offsets": [0]}}, bytes(32), "tensor a has malformed data_offsets [0]"),
        ([1, 2], b"", "not a safetensors file: its header is not a JSON object"),
    ]
    for header, data, message in cases:
        with pytest.raises(ModelFileError) as e:
            check_safetensors_header(_safetensors(tmp_path / "m.safetensors", header, data))
        assert str(e.value).startswith("m.safetensors: " + message), str(e.value)
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelFileError, match=r"^m.safetensors: not a safetensors file: a header of 2\^40 bytes"):
        check_safetensors_header(tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 5) + b"{not json")
    with pytest.raises(ModelFileError, match="^m.safetensors: not a safetensors file: its header is not JSON$"):
        check_safetensors_header(tmp_path / "m.safetensors")
    (tmp_path / "m.safetensors").write_bytes(b"\x01")
    with pytest.raises(ModelFileError, match="shorter than its 8-byte header length"):
        check_safetensors_header(tmp_path / "m.safetensors")


def test_a_config_is_checked_against_the_tensor_shapes():
    shapes = {"model.embed_tokens.weight": (400, 64), "model.layers.0.self_attn.q_proj.weight": (64, 64),
              "model.layers.0.self_attn.k_proj.weight": (32, 64), "model.layers.0.mlp.down_proj.weight": (64, 128),
              "model.layers.1.input_layernorm.weight": (64,), "visual.blocks.31.attn.qkv.weight": (96, 32)}
    true = Described(num_layers=2, vocab_size=400, hidden_size=64, intermediate_size=128, q_rows=64, kv_rows=32)
    check_config("config.json", true, shapes)  # the vision tower's blocks are not the decoder's layers
    cases = [
        ({"num_layers": 1_000_000_000}, "the config says 1,000,000,000 layers, the checkpoint's tensors have 2"),
        ({"hidden_size": 1 << 30}, "the config's vocabulary and hidden size gives model.embed_tokens.weight the shape "
                                   "400 x 2^30, the checkpoint holds 400 x 64"),
        ({"intermediate_size": 4096}, "the config's intermediate size gives model.layers.0.mlp.down_proj.weight the shape "
                                      "64 x 4,096, the checkpoint holds 64 x 128"),
        ({"kv_rows": 64}, "the config's key-value heads and head size gives model.layers.0.self_attn.k_proj.weight"),
        ({"q_rows": 0}, "the config gives q rows 0"),
    ]
    for change, message in cases:
        with pytest.raises(ModelFileError) as e:
            check_config("/models/x/config.json", Described(**{**true.__dict__, **change}), shapes)
        assert str(e.value).startswith("config.json: " + message)


# ---------------------------------------------------------------- a corpus of broken files

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A tiny llama as a Hugging Face folder and as a GGUF (Q8_0 attention, F32 elsewhere), a GGUF holding an
    array one entry over the limit, which its bytes could hold, and one holding an array of arrays."""
    from test_loader import write_gguf
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("model-files")
    folder = make_tiny_model("llama", root / "hf")
    write_gguf(folder, root / "good.gguf", "llama", {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0})
    write_gguf(folder, root / "big-array.gguf", "llama", {},
               extra=lambda w: w.add_array("shoal.test.flags", [False] * (MAX_ARRAY_ENTRIES + 1)))
    write_gguf(folder, root / "nested-array.gguf", "llama", {}, extra=lambda w: w.add_array("shoal.test.nested", [[1, 2], [3]]))
    return root


def _gguf_cases(good: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (the file's bytes, the message its load must give after "<name>.gguf: ")."""
    blob, reader = good.read_bytes(), gguf.GGUFReader(good)

    def at(key: str) -> int:  # where a scalar's value starts: key length, key, type
        field = reader.fields[key]
        return field.offset + 8 + len(key) + 4

    def patch(data: bytes, offset: int, fmt: str, value) -> bytes:
        return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]

    first, second, final = reader.tensors[0], reader.tensors[1], reader.tensors[-1]

    def info(t) -> int:  # where a tensor's dimension count starts
        return t.field.offset + 8 + len(t.name)

    tokens = reader.fields["tokenizer.ggml.tokens"]
    last = max(reader.tensors, key=lambda t: t.data_offset)
    end = last.data_offset + last.n_bytes
    cases = {
        "cut-in-header": (blob[:10], "truncated: the GGUF header needs bytes 0–24, the file has 10"),
        "cut-in-vocabulary": (blob[:tokens.offset + 200], "metadata 'tokenizer.ggml.tokens' counts 400 entries, more than"),
        "cut-in-tensor-index": (blob[:first.field.offset + 12], f"the header counts {len(reader.tensors)} tensors, more than the 12 bytes"),
        "cut-in-last-tensor-name": (blob[:final.field.offset + 12], f"truncated: tensor {len(reader.tensors)} of {len(reader.tensors)} "
                                                                    f"needs bytes {final.field.offset + 8:,}–"),
        "cut-one-byte-short": (blob[:end - 1], f"truncated: tensor {last.name} needs bytes {last.data_offset:,}–{end:,}, "
                                               f"the file has {end - 1:,}"),
        "wrong-magic": (b"GGUX" + blob[4:], "not a GGUF file (it does not start with the GGUF magic)"),
        "future-version": (patch(blob, 4, "<I", 7), "unsupported GGUF version 7 (shoal reads versions 2 and 3)"),
        "tensor-count": (patch(blob, 8, "<Q", 1 << 40), "the header counts 2^40 tensors, more than"),
        "metadata-count": (patch(blob, 16, "<Q", 1 << 40), "the header counts 2^40 metadata entries, more than"),
        "array-count": (patch(blob, tokens.offset + 8 + len("tokenizer.ggml.tokens") + 8, "<Q", 1 << 40),
                        "metadata 'tokenizer.ggml.tokens' counts 2^40 entries, more than"),
        "string-length": (patch(blob, at("general.architecture"), "<Q", 1 << 40),
                          "metadata 'general.architecture' is a string of 2^40 bytes (shoal reads at most 2^26)"),
        "value-type": (patch(blob, at("general.architecture") - 4, "<I", 99), "metadata 'general.architecture' has an unknown GGUF value type 99"),
        "dimension-count": (patch(blob, info(first), "<I", 9), f"tensor {first.name} has 9 dimensions (GGUF allows 4)"),
        "absurd-dimension": (patch(blob, info(first) + 4, "<Q", 1 << 63), f"tensor {first.name} has absurd dimensions 2^63 x"),
        "huge-dimension": (patch(blob, info(first) + 4, "<Q", 1 << 40), f"truncated: tensor {first.name} needs bytes"),
        "tensor-type": (patch(blob, info(first) + 4 + 8 * len(first.shape), "<I", 200), f"tensor {first.name} has an unknown tensor type 200"),
        "offset-past-end": (patch(blob, info(first) + 8 + 8 * len(first.shape), "<Q", 1 << 40), f"truncated: tensor {first.name} needs bytes"),
        "overlap": (patch(blob, info(second) + 8 + 8 * len(second.shape), "<Q", first.data_offset - reader.data_offset),
                    f"tensors {second.name} and {first.name} overlap (bytes {first.data_offset:,}–{first.data_offset + second.n_bytes:,})"),
        "unaligned": (patch(blob, info(second) + 8 + 8 * len(second.shape), "<Q", second.data_offset - reader.data_offset + 1),
                      f"tensor {second.name} starts at byte {second.data_offset + 1:,}, not on the file's 32-byte alignment"),
        "lying-width": (patch(blob, at("llama.embedding_length"), "<I", 1 << 30),
                        "the config's vocabulary and hidden size gives model.embed_tokens.weight the shape 400 x 2^30, "
                        "the checkpoint holds 400 x 64"),
        "lying-depth": (patch(blob, at("llama.block_count"), "<I", 100_000), "the config says 100,000 layers, the checkpoint's tensors have 3"),
        "not-utf8": (blob.replace(b"<|im_start|>", b"<|im_st\xffrt|>", 1), "metadata 'tokenizer.ggml.tokens' holds a string that is not UTF-8"),
        "no-architecture": (blob.replace(b"general.architecture", b"general.architectur_", 1), "GGUF architecture None is not supported"),
    }
    rng = np.random.default_rng(0)
    for i in range(24):  # bit flips in the header: a clean refusal or a load, never another error
        flipped = bytearray(blob)
        for pos in rng.integers(0, reader.data_offset, 3):
            flipped[int(pos)] ^= 1 << int(rng.integers(0, 8))
        cases[f"flip-{i}"] = (bytes(flipped), None)
    return cases


def _folder_cases(folder: Path) -> dict[str, tuple[dict[str, bytes], str]]:
    """name -> ({file in the folder: its new bytes}, the message, which names the file)."""
    st = (folder / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", st[:8])[0]
    header = json.loads(st[8:8 + length])
    config = json.loads((folder / "config.json").read_text())
    embed = next(k for k in header if k.endswith("embed_tokens.weight"))

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + st[8 + length:]

    def with_config(**change) -> bytes:
        return json.dumps({**config, **change}).encode()

    lying = {**header, embed: {**header[embed], "shape": [1 << 20, 1 << 20]}}
    return {
        "st-cut": ({"model.safetensors": st[: len(st) // 2]}, "model.safetensors: truncated: tensor "),
        "st-cut-in-header": ({"model.safetensors": st[: 8 + length // 2]}, f"model.safetensors: truncated: the header needs bytes 8–{8 + length:,}"),
        "st-header-length": ({"model.safetensors": struct.pack("<Q", 1 << 40) + st[8:]}, "model.safetensors: not a safetensors file: a header of 2^40 bytes"),
        "st-lying-shape": ({"model.safetensors": with_header(lying)}, f"model.safetensors: tensor {embed}: shape [1048576, 1048576] of F32 is 2^42 bytes"),
        "st-garbage": ({"model.safetensors": b"\x10" + bytes(7) + b"x" * 64}, "model.safetensors: not a safetensors file: its header is not JSON"),
        "config-depth": ({"config.json": with_config(num_hidden_layers=1_000_000_000)}, "config.json: the config says 1,000,000,000 layers"),
        "config-width": ({"config.json": with_config(hidden_size=1 << 24, head_dim=16)},
                         "config.json: the config's vocabulary and hidden size gives model.embed_tokens.weight the shape 400 x 2^24"),
        "config-not-json": ({"config.json": b"{\"model_type\": "}, "config.json: not a usable model config"),
        "tokenizer-not-json": ({"tokenizer.json": b"{\"version\": \"1.0\", \"model\": "}, "tokenizer-not-json: its tokenizer cannot be loaded ("),
        "generation-config-not-json": ({"generation_config.json": b"[1, 2"}, "generation_config.json: not a JSON file"),
        "index-escape": ({"model.safetensors.index.json": json.dumps({"weight_map": {embed: "../../../../etc/passwd"}}).encode()},
                         "model.safetensors.index.json: lists '../../../../etc/passwd', which is not a file in"),
    }


# Loads every file through the engine's own build (runner/build.build_part) in a fresh process, and reports each
# outcome and the process's peak RSS before and after the bad files.
_LOADER = textwrap.dedent("""
    import json, resource, sys
    from shoal.config import CacheConfig, EngineConfig
    from shoal.runner.build import build_part

    def build(path):
        return build_part(EngineConfig(model=path, dtype="float32", cache=CacheConfig(num_blocks=128, block_size=8)))

    good, bad = sys.argv[1], json.loads(sys.argv[2])
    build(good)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for name, path in bad.items():
        try:
            build(path)
            out[name] = ["loaded", ""]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"outcomes": out, "peak_kib": [before, after]}))
""")


def test_broken_and_hostile_files_get_one_line_and_bounded_memory(tiny_files, tmp_path):
    good = tiny_files / "good.gguf"
    expected, paths = {}, {}
    for name, (blob, message) in _gguf_cases(good).items():
        (tmp_path / f"{name}.gguf").write_bytes(blob)
        paths[name], expected[name] = str(tmp_path / f"{name}.gguf"), (f"{name}.gguf: {message}" if message else None)
    for name, (files, message) in _folder_cases(tiny_files / "hf").items():
        shutil.copytree(tiny_files / "hf", tmp_path / name)
        for file, blob in files.items():
            (tmp_path / name / file).write_bytes(blob)
        paths[name], expected[name] = str(tmp_path / name), message
    paths["big-array"] = str(tiny_files / "big-array.gguf")
    paths["nested-array"] = str(tiny_files / "nested-array.gguf")
    expected["nested-array"] = "nested-array.gguf: metadata 'shoal.test.nested' is an array of arrays, which GGUF readers do not take"
    expected["big-array"] = (f"big-array.gguf: metadata 'shoal.test.flags' is an array of {MAX_ARRAY_ENTRIES + 1:,} entries "
                             "(shoal reads at most 2^21 in one, 2^22 in all)")

    run = subprocess.run([sys.executable, "-c", _LOADER, str(good), json.dumps(paths)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    outcomes = report["outcomes"]
    for name, message in expected.items():
        kind, text = outcomes[name]
        if message is None:  # a bit flip: it may still load; if not, it is refused in one line naming the file
            assert kind in ("loaded", "ModelFileError"), (name, kind, text)
            assert kind == "loaded" or (text.startswith(f"{name}.gguf: ") and "\n" not in text), (name, text)
            continue
        assert kind == "ModelFileError" and "\n" not in text, (name, kind, text)
        assert text.startswith(message), (name, text)
    assert sum(outcomes[n][0] == "ModelFileError" for n in outcomes if n.startswith("flip-")) >= 12  # the flips did hit
    before, after = report["peak_kib"]
    assert after - before < 256 * 1024, f"the bad files raised the peak RSS by {(after - before) >> 10} MiB"


def test_a_cut_mmproj_names_itself(tmp_path):
    from gguf_vl import write_vl_gguf_pair
    from tiny_models import make_tiny_vl_model

    from shoal.model.mmproj import read_mmproj

    _, mmproj = write_vl_gguf_pair(make_tiny_vl_model("qwen2_vl", tmp_path / "hf"), tmp_path)
    blob = mmproj.read_bytes()
    (tmp_path / "cut-mmproj.gguf").write_bytes(blob[: len(blob) * 2 // 3])
    with pytest.raises(ModelFileError, match=r"^cut-mmproj.gguf: truncated: tensor v\.\S+ needs bytes [\d,]+–[\d,]+, the file has"):
        read_mmproj(tmp_path / "cut-mmproj.gguf")


def test_a_bad_file_fails_its_model_and_the_others_keep_serving(tiny_files, tmp_path):
    from server_utils import LiveServer, tiny_engine_config

    from shoal.server.models import ModelSpec

    blob = (tiny_files / "good.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(blob[: len(blob) // 2])
    specs = [ModelSpec("good", tiny_engine_config(tiny_files / "good.gguf")), ModelSpec("cut", tiny_engine_config(tmp_path / "cut.gguf"))]
    with LiveServer(specs) as srv, srv.http() as h:
        r = h.post("/v1/models", json={"model": "cut"})
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert message.startswith("model 'cut' failed to load: cut.gguf: truncated: tensor ") and str(tmp_path) not in message
        card = h.get("/v1/models/cut").json()
        assert card["status"]["value"] == "failed" and card["status"]["reason"].startswith("cut.gguf: truncated: tensor ")
        for _ in range(2):
            answer = h.post("/v1/completions", json={"model": "good", "prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert h.post("/v1/completions", json={"model": "cut", "prompt": "hello", "max_tokens": 4}).status_code == 503
