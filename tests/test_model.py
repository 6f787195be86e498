"""The model: seeded init, fp32 weights, and `from_pretrained` on a local folder (no hub access)."""

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from swarm.config import ConfigError
from swarm.errors import UsageError
from swarm.run.configfile import load_config
from swarm.train.model import build_model
from tests.conftest import tiny_config

pytestmark = pytest.mark.timeout(60)


def test_seeded_init_is_the_same_on_every_peer_and_differs_by_seed():
    cfg = tiny_config()
    a, b = build_model(cfg.model, 256), build_model(cfg.model, 256)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    other = build_model(tiny_config(model={"seed": 1}).model, 256)
    assert not torch.equal(next(a.parameters()), next(other.parameters()))


def test_a_sharded_model_is_cut_before_its_weights_exist_and_each_tensor_has_a_seed_of_its_own():
    """`shard` (FSDP2's fully_shard on a sharded peer) sees the model on the meta device: no rank ever holds the
    whole model. A tensor's values follow from the seed and its name alone, so a rank makes each whole tensor in
    turn and keeps its rows: K never changes the model (tests/test_sharding.py trains K = 2 against one process)."""
    cfg = tiny_config().model
    weightless = []
    model = build_model(cfg, 256, shard=lambda m: weightless.append(all(p.is_meta for p in m.parameters())))
    assert weightless == [True] and not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    deeper = dict(build_model(dataclasses.replace(cfg, num_layers=cfg.num_layers + 1), 256).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, deeper[name]), name  # another tensor more changes none of them
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert 0.015 < model.model.embed_tokens.weight.std().item() < 0.025  # normal(0, initializer_range 0.02)
    plain = LlamaForCausalLM(model.config)  # the rotary tables, computed again on the device the model got
    assert torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    assert build_model(cfg, 256, device="meta").model.embed_tokens.weight.is_meta  # shapes only


def test_weights_are_fp32_even_for_bf16_training():
    model = build_model(tiny_config(inner={"precision": "bf16"}).model, 256)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_from_pretrained_local_folder(tmp_path):
    cfg = tiny_config()
    build_model(cfg.model, 256).save_pretrained(tmp_path / "saved")
    loaded = build_model(tiny_config(model={"pretrained": str(tmp_path / "saved")}).model, 256)
    original = build_model(cfg.model, 256)
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), original.parameters()))


def test_missing_pretrained_path_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="model.pretrained"):
        build_model(tiny_config(model={"pretrained": str(tmp_path / "nope")}).model, 256)


def test_retired_model_dtype_names_its_replacement():
    with pytest.raises(ConfigError, match="'model.dtype' was replaced by inner.precision"):
        load_config(None, {"model": {"dtype": "bfloat16"}})
