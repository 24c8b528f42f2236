"""llama.cpp's Qwen2-VL / Qwen2.5-VL GGUF pair (decoder + mmproj) against the Hugging Face folder it came from.

tests/gguf_vl.py writes the pair the way convert_hf_to_gguf.py does; shoal reads it back:
* the mmproj (model/mmproj.py) to exactly the folder's visual.* tensors, a vision config whose transformers
  tower computes what the folder's model computes, and the folder's image settings;
* the decoder (model/gguf_loader.py, arch "qwen2vl") to the folder's text tensors, with M-RoPE sections.
"""

from __future__ import annotations

import importlib

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from PIL import Image
from safetensors.torch import load_file

from tiny_models import VL_ARCHS

from gguf_vl import write_vl_gguf_pair
from shoal.model.gguf_loader import GGUFFileReader, load_gguf, mrope_section
from shoal.model.loader import normalize_names
from shoal.model.mmproj import build_vision_config, read_mmproj, unswap_legacy_ffn
from tiny_models import make_tiny_vl_model

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TOWERS = {  # family -> (vision config class, tower class), in transformers.models.<family>.modeling_<family>
    "qwen2_vl": ("Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF folder, text GGUF, mmproj GGUF) with the folder's pixel limits written into the mmproj."""
    family = request.param
    folder = make_tiny_vl_model(family, tmp_path_factory.mktemp(family) / "hf")
    text, mmproj = write_vl_gguf_pair(folder, folder.parent / "gguf", pixel_limits=True)
    return family, folder, text, mmproj


def hf_visual(folder) -> dict[str, torch.Tensor]:
    return {k.removeprefix("visual."): v for k, v in load_file(folder / "model.safetensors").items() if k.startswith("visual.")}


def build_tower(family: str, vision_config: dict, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    config_cls, tower_cls = TOWERS[family]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(importlib.import_module(f"transformers.models.{family}.configuration_{family}"), config_cls)(**vision_config)
    tower = getattr(module, tower_cls)._from_config(config, dtype=torch.float32)
    tower.load_state_dict(state_dict, strict=True)
    return tower.eval()


def test_mmproj_tensors_are_the_checkpoints_visual_tensors(pair):
    family, folder, _, mmproj = pair
    mm = read_mmproj(mmproj)
    assert mm.family == family
    expected = hf_visual(folder)
    assert sorted(mm.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert mm.state_dict[name].dtype == torch.float32
        assert torch.equal(mm.state_dict[name], tensor), name


def test_mmproj_tower_computes_the_checkpoints_visual_output(pair):
    family, folder, _, mmproj = pair
    mm = read_mmproj(mmproj)
    reference = getattr(transformers, transformers.AutoConfig.from_pretrained(folder).architectures[0]).from_pretrained(folder).eval()
    tower = build_tower(family, mm.vision_config, mm.state_dict)
    # 168 x 224 pixels: 6 x 8 merged tokens, so Qwen2.5-VL's 2 x 2 windows (56 pixels) split it into 12
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (168, 224, 3), dtype=np.uint8))
    pixels = transformers.AutoImageProcessor.from_pretrained(folder)(images=[image], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 12, 16]]
    with torch.no_grad():
        ours = tower(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output
        theirs = reference.model.visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output
    assert ours.shape == theirs.shape == (48, 64)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_mmproj_vision_config_is_the_checkpoints(pair):
    family, folder, _, mmproj = pair
    mm = read_mmproj(mmproj)
    config_cls, _ = TOWERS[family]
    ours = getattr(importlib.import_module(f"transformers.models.{family}.configuration_{family}"), config_cls)(**mm.vision_config)
    theirs = transformers.AutoConfig.from_pretrained(folder).vision_config
    skip = {"initializer_range", "tokens_per_second", "transformers_version"}  # not in the file; no effect on images
    assert {k: v for k, v in ours.to_dict().items() if k not in skip} == {k: v for k, v in theirs.to_dict().items() if k not in skip}


def test_mmproj_processor_settings_are_the_folders(pair):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, folder, _, mmproj = pair
    ours = Qwen2VLImageProcessorPil(**read_mmproj(mmproj).processor).to_dict()
    theirs = transformers.AutoImageProcessor.from_pretrained(folder).to_dict()
    for key in ("image_mean", "image_std"):  # stored as float32
        assert ours.pop(key) == pytest.approx(theirs.pop(key), rel=1e-7)
    assert ours == theirs


def test_mmproj_without_pixel_limits_or_window_takes_llamacpp_defaults(pair, tmp_path):
    """A file as the converter writes it for Qwen2-VL: no pixel limits (clip.cpp: 8 to 4096 merged tokens)
    and, for Qwen2.5-VL, no window size (clip.cpp: 112 pixels)."""
    family, folder, _, _ = pair
    _, mmproj = write_vl_gguf_pair(folder, tmp_path)
    mm = read_mmproj(mmproj)
    assert (mm.processor["min_pixels"], mm.processor["max_pixels"]) == (8 * 28 * 28, 4096 * 28 * 28)
    if family == "qwen2_5_vl":
        meta = {k: v for k, v in GGUFFileReader(mmproj).metadata.items() if k != "clip.vision.window_size"}
        assert build_vision_config(meta, mm.state_dict, family)["window_size"] == 112


def test_text_gguf_loads_the_checkpoints_decoder(pair):
    family, folder, text, _ = pair
    ckpt = load_gguf(text, progress=False)
    hf = transformers.AutoConfig.from_pretrained(folder)
    raw = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("visual.")}
    expected = normalize_names(raw, tied=False)
    assert sorted(ckpt.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.state_dict[name], tensor), name
    config = ckpt.config
    assert isinstance(config, transformers.Qwen2VLTextConfig)
    # one llama.cpp arch for both families: the mmproj's projector type tells Qwen2.5-VL apart
    assert config.architectures == ["Qwen2VLForConditionalGeneration"]
    assert config.rope_parameters["mrope_section"] == hf.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"):
        assert getattr(config, key) == getattr(hf.text_config, key), key
    assert config.rms_norm_eps == pytest.approx(hf.text_config.rms_norm_eps, rel=1e-7)  # stored as float32
    assert config.tie_word_embeddings is False
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = reference.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this? café 42"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    assert "<|image_pad|>" in prompt
    assert ckpt.tokenizer(prompt).input_ids == reference(prompt).input_ids
    assert ckpt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ) == reference.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_f16_mmproj_stores_like_llamacpp_and_reads_back(tmp_path):
    """--outtype f16: the patch kernels and matrices in F16, biases and norms in F32."""
    folder = make_tiny_vl_model("qwen2_5_vl", tmp_path / "hf")
    _, mmproj = write_vl_gguf_pair(folder, tmp_path / "gguf", outtype="f16")
    kinds = {t.name: t.tensor_type for t in GGUFFileReader(mmproj).tensors}
    assert kinds["v.patch_embd.weight"] == kinds["v.patch_embd.weight.1"] == Q.F16
    assert kinds["v.blk.0.attn_q.weight"] == kinds["v.blk.1.ffn_gate.weight"] == kinds["mm.2.weight"] == Q.F16
    assert kinds["v.blk.0.attn_q.bias"] == kinds["v.blk.0.ln1.weight"] == kinds["v.post_ln.weight"] == Q.F32
    mm = read_mmproj(mmproj)
    for name, tensor in hf_visual(folder).items():
        stored = tensor.half().float() if tensor.dim() > 1 else tensor
        assert torch.equal(mm.state_dict[name], stored), name


def test_text_gguf_is_not_an_mmproj(pair):
    _, _, text, _ = pair
    with pytest.raises(ValueError, match="general.architecture is 'qwen2vl'"):
        read_mmproj(text)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"clip.has_vision_encoder": True, "clip.projector_type": "gemma3"}, "projector type 'gemma3' is not supported"),
        ({"clip.has_audio_encoder": True, "clip.projector_type": "qwen2a"}, "no vision encoder"),
    ],
)
def test_unsupported_mmproj_is_refused(tmp_path, keys, message):
    path = tmp_path / "mmproj.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    for key, value in keys.items():
        (writer.add_bool if isinstance(value, bool) else writer.add_string)(key, value)
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 3, 14, 14), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        read_mmproj(path)


def test_mmproj_with_a_foreign_tensor_is_refused(pair, tmp_path):
    """A tensor the tower has no place for (here a pre-norm, which Qwen2-VL lacks) is named, not dropped."""
    family, _, _, mmproj = pair
    reader = GGUFFileReader(mmproj)
    path = tmp_path / "mmproj.gguf"
    writer = gguf.GGUFWriter(str(path), "clip")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            value = field.contents()
            kind = field.types[0]
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.add_tensor("v.pre_ln.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"no place in the .* tower: \['v.pre_ln.weight'\]"):
        read_mmproj(path)


def test_legacy_swapped_ffn_is_swapped_back():
    """Old surgery-script files hold up and down under each other's names (clip.cpp's is_ffn_swapped)."""
    up, down = torch.randn(64, 32), torch.randn(32, 64)  # [out, in] of fc1 and fc2 over a 32-wide embedding
    swapped = {"blocks.0.mlp.fc1.weight": down, "blocks.0.mlp.fc2.weight": up, "blocks.0.mlp.fc1.bias": torch.zeros(32), "blocks.0.mlp.fc2.bias": torch.ones(64)}
    fixed = unswap_legacy_ffn(dict(swapped), "qwen2_vl", embed_dim=32)
    assert fixed["blocks.0.mlp.fc1.weight"] is up and fixed["blocks.0.mlp.fc2.weight"] is down
    assert fixed["blocks.0.mlp.fc1.bias"].shape == (64,)
    assert unswap_legacy_ffn(dict(fixed), "qwen2_vl", embed_dim=32)["blocks.0.mlp.fc1.weight"] is up  # right already


def test_qwen2vl_gguf_needs_its_rope_sections():
    assert mrope_section({"qwen2vl.rope.dimension_sections": [16, 24, 24, 0]}, "qwen2vl") == [16, 24, 24]
    with pytest.raises(ValueError, match="qwen2vl.rope.dimension_sections"):
        mrope_section({}, "qwen2vl")


def test_a_gguf_and_its_mmproj_answer_as_the_folder_does(pair, tmp_path):
    """`--mmproj`: the llama.cpp pair serves images, with the folder's greedy tokens for the same picture."""
    from shoal import LLM, SamplingParams
    from shoal.multimodal import pixel_digest
    from test_vision import picture

    family, folder, text_gguf, mmproj = pair
    image = picture(150, 100, 5)
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", attention="invariant", max_model_len=256, num_blocks=64, block_size=4)
    ours = LLM(str(text_gguf), mmproj=str(mmproj), **kw)
    assert ours.engine.vision is not None and ours.engine.facts.architecture == VL_ARCHS[family][1]
    want = LLM(str(folder), **kw).chat(chat, greedy)[0].outputs[0].token_ids
    assert ours.chat(chat, greedy)[0].outputs[0].token_ids == want
    assert ours.engine.vision.prepare(image, pixel_digest(image)).length == 20
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF"):
        LLM(str(folder), mmproj=str(mmproj), **kw)


def test_mmproj_goes_with_the_first_served_model_only():
    from shoal.cli import build_parser, model_specs, serve_values

    a = build_parser().parse_args(["serve", "--model", "a.gguf", "--model", "b.gguf", "--mmproj", "mm.gguf"])
    specs = model_specs(serve_values(a))
    assert [s.config.mmproj for s in specs] == ["mm.gguf", None]


def test_models_dir_takes_a_folder_of_a_gguf_and_its_mmproj_as_one_vision_model(pair, tmp_path):
    """llama.cpp's router layout: a multimodal model in its own folder, with every part."""
    import shutil

    from shoal.config import EngineConfig
    from shoal.server.models import specs_in_dir

    family, _, text_gguf, mmproj = pair
    (tmp_path / "eyes").mkdir()
    shutil.copy(text_gguf, tmp_path / "eyes" / "model.gguf")
    shutil.copy(mmproj, tmp_path / "eyes" / "mmproj-model-f32.gguf")
    shutil.copy(text_gguf, tmp_path / "plain.gguf")
    specs = {s.name: s.config for s in specs_in_dir(tmp_path, EngineConfig())}
    assert sorted(specs) == ["eyes", "plain"]
    assert specs["eyes"].model.endswith("eyes/model.gguf") and specs["eyes"].mmproj.endswith("mmproj-model-f32.gguf")
    assert specs["plain"].mmproj is None
