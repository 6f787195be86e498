"""The inner loop: micro-batches give the step one big batch gives, bf16 autocast keeps fp32 weights and
optimizer state, and the shipped real-model recipes build and take inner steps (on CPU, shrunk batches)."""

import sys

import pytest
import torch

from swarm.config import ConfigError
from swarm.run.configfile import load_config
from swarm.train.averaging import SoloAverager
from swarm.train.inner import autocast, evaluate
from swarm.train.trainer import Trainer
from tests.conftest import ROOT, resumed_after, tiny_config


def _train_steps(cfg, tmp_path, name: str, steps: int) -> tuple[Trainer, list[float]]:
    trainer = Trainer(cfg, SoloAverager(), name, shard=0, out_dir=tmp_path / name, name="peer")  # one batch order
    return trainer, [trainer.inner_step() for _ in range(steps)]


@pytest.mark.timeout(60)
def test_micro_batches_take_the_step_one_big_batch_takes(tmp_path):
    whole, whole_losses = _train_steps(tiny_config(data={"batch_size": 8}), tmp_path, "whole", 3)
    micro, micro_losses = _train_steps(tiny_config(data={"batch_size": 8}, inner={"micro_batch_size": 2}),
                                       tmp_path, "micro", 3)
    assert micro_losses == pytest.approx(whole_losses, abs=1e-5)
    for p, q in zip(whole.model.parameters(), micro.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    moved = max((p - g.to(p)).abs().max().item() for p, g in zip(whole.model.parameters(),
                                                                 whole.diloco.global_params))
    assert moved > 1e-3  # the steps changed the weights: the comparison above is not vacuous


@pytest.mark.timeout(60)
def test_evaluation_runs_in_micro_batches_and_its_largest_tensor_is_one_micro_batch_s(tmp_path):
    """The largest tensor an eval makes is the logits of one pass (tokens x vocabulary); under
    `inner.micro_batch_size` it is one micro-batch's, and the loss is the whole batch's."""
    cfg = tiny_config(data={"batch_size": 8}, inner={"micro_batch_size": 2})
    trainer, _ = _train_steps(cfg, tmp_path, "peer", 0)
    largest = []
    hook = trainer.model.get_output_embeddings().register_forward_hook(
        lambda module, args, logits: largest.append(logits.numel()))
    whole = evaluate(trainer.model, trainer.eval_batches, "cpu")
    by_whole_batch, largest[:] = max(largest), []
    micro = evaluate(trainer.model, trainer.eval_batches, "cpu", micro_batch_size=2)
    hook.remove()
    vocab, seq_len = trainer.model.config.vocab_size, cfg.data.seq_len
    assert max(largest) <= 2 * seq_len * vocab < by_whole_batch == 8 * seq_len * vocab
    assert micro == pytest.approx(whole, rel=1e-6)


@pytest.mark.timeout(60)
def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_state(tmp_path):
    cfg = tiny_config(inner={"precision": "bf16", "micro_batch_size": 2})
    trainer = Trainer(cfg, SoloAverager(), "bf16", shard=0, out_dir=tmp_path, name="peer")
    seen = []
    trainer.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    losses = [trainer.inner_step() for _ in range(3)]
    _, fp32_losses = _train_steps(tiny_config(inner={"micro_batch_size": 2}), tmp_path, "fp32", 3)
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    assert all(g.dtype == torch.float32 for g in trainer.diloco.global_params)
    assert losses == pytest.approx(fp32_losses, abs=0.05) and losses != fp32_losses


def test_micro_batch_that_does_not_divide_the_batch_names_the_key():
    with pytest.raises(ConfigError, match="inner.micro_batch_size 3 does not divide data.batch_size 8"):
        tiny_config(data={"batch_size": 8}, inner={"micro_batch_size": 3})


def test_bf16_on_a_device_without_it_is_a_usage_error():
    with pytest.raises(ConfigError, match="inner.precision bf16: not supported on device meta"):
        autocast("bf16", "meta")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", ["llama-150m", "llama-1b"])
def test_real_recipe_loads_and_the_150m_architecture_takes_inner_steps_on_cpu(recipe, tmp_path):
    """The shipped recipes cannot rot: both load; the 150M one trains two inner steps and one round on CPU
    with its own architecture, precision and micro-batching, shrunk to 2 sequences of 32 tokens."""
    cfg = load_config(ROOT / "configs" / f"{recipe}.yaml")
    assert cfg.inner.precision == "bf16" and cfg.data.batch_size % cfg.inner.micro_batch_size == 0
    assert 0 < cfg.diloco.delay <= cfg.diloco.inner_steps // 10  # overlap on: a small share of H (README)
    if recipe != "llama-150m":
        return
    cfg = load_config(ROOT / "configs" / f"{recipe}.yaml", [
        "--diloco.device", "cpu", "--diloco.rounds", "1", "--diloco.inner_steps", "2", "--diloco.delay", "1", "--diloco.threads", "2",
        "--data.batch_size", "2", "--inner.micro_batch_size", "1", "--data.seq_len", "32", "--data.eval_batches",
        "1", "--data.max_documents", "40", "--inner.warmup_steps", "1", "--checkpoint.every", "0",
        "--logging.progress_bar", "false", "--data.source", "embedded", "--data.tokenizer", "bytes"])  # no C4 here
    trainer = Trainer(cfg, SoloAverager(), "smoke", shard=0, out_dir=tmp_path)
    assert 140e6 < sum(p.numel() for p in trainer.model.parameters()) < 160e6
    history = trainer.train()
    assert len(history.rounds) == 1 and history.rounds[0].committed
    assert history.rounds[0].eval_loss < history.initial_eval_loss


@pytest.mark.timeout(120)
def test_adamw8bit_trains_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    cfg = tiny_config(inner={"optimizer": "adamw8bit"}, diloco={"rounds": 3, "inner_steps": 3})
    straight = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "straight")
    history = straight.train()
    assert history.rounds[-1].eval_loss < history.initial_eval_loss
    moments = straight.optimizer.state[straight.model.model.embed_tokens.weight]
    assert moments["state1"].dtype == torch.uint8 and moments["step"] == 9  # 8-bit moments, counted in ints

    second = resumed_after(cfg, tmp_path / "resumed", stop_round=1)
    assert [r.eval_loss for r in second.progress.history.rounds] == [r.eval_loss for r in history.rounds]
    assert second.diloco.global_sha256() == straight.diloco.global_sha256()


def test_adamw8bit_where_bitsandbytes_cannot_run_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ConfigError, match="inner.optimizer adamw8bit: bitsandbytes cannot run on cpu here"):
        Trainer(tiny_config(inner={"optimizer": "adamw8bit"}), SoloAverager(), "a", shard=0, out_dir=tmp_path)
