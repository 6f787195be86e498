"""The model: seeded init, fp32 weights, and `from_pretrained` on a local folder (no hub access)."""

import pytest
import torch

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
