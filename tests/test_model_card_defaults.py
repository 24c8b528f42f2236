"""Sampling defaults from a model's card, for checkpoints that ship none of their own.

SmolLM2's authors recommend temperature 0.2 and top_p 0.9; its GGUF carries no
sampling metadata, and at the built-in temperature 1.0 it answers simple
questions with nonsense.
"""

import logging

import pytest

from shoal.model.loader import load_checkpoint
from tiny_models import make_tiny_model

SMOLLM2_CARD = {"temperature": 0.2, "top_p": 0.9}


@pytest.mark.slow
def test_the_default_model_gets_its_card_defaults(default_checkpoint):
    assert default_checkpoint.generation_defaults == SMOLLM2_CARD
    assert default_checkpoint.defaults_source == "the smollm2 model card"


def test_a_tiny_model_without_a_generation_config_gets_none(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny-llama")
    (folder / "generation_config.json").unlink()
    ckpt = load_checkpoint(folder, progress=False)
    assert ckpt.generation_defaults == {} and ckpt.defaults_source == "none"


def test_card_defaults_only_stand_in_for_the_models_own(tmp_path, caplog):
    folder = make_tiny_model("llama", tmp_path / "SmolLM2-tiny-Instruct")
    ckpt = load_checkpoint(folder, progress=False)
    assert ckpt.generation_defaults == {"temperature": 0.7}  # its generation_config.json, not mixed with the card
    assert ckpt.defaults_source == "the model's files"
    (folder / "generation_config.json").unlink()
    with caplog.at_level(logging.INFO, logger="shoal.loader"):
        ckpt = load_checkpoint(folder, progress=False)
    assert ckpt.generation_defaults == SMOLLM2_CARD
    assert any("sampling defaults from the smollm2 model card" in r.getMessage() for r in caplog.records)
