"""`swarm export`: a peer's committed global parameters as a Hugging Face model folder.

    swarm export runs/<run>/peer-0 --hf-out model      # or a checkpoint folder, or one round of it

The source is a peer's last complete checkpoint (swarm/checkpoint.py: checkpoints are renamed into place whole,
and a reader keeps what it opened even if the peer prunes it, so a peer that is still training can be exported).
The model is built from the checkpoint's meta: the model's Hugging Face config (`hf_config`), or for older
checkpoints the run's config (`config`; the oldest, without either: pass `--config`); its `global.<param>`
tensors, the parameters the swarm committed, replace the weights by name (the rest of the checkpoint is not
read). `swarm export --from-swarm RUN` takes them from the swarm instead (peers/export_swarm.py). Written by
`write_hf`: `config.json`, `model.safetensors` (sharded above 5 GB), `generation_config.json` and the
tokenizer, a Hugging Face tokenizer's own files or, for byte tokens, a byte-level tokenizer with no merges
that `AutoTokenizer` loads and that gives the same ids. The folder appears whole or not at all: it is written
beside the target and renamed into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from swarm import checkpoint_legacy as legacy
from swarm.checkpoint import INDEX, ROUND, Checkpointer, CorruptCheckpoint
from swarm.config import Config
from swarm.configfile import config_from_dict, load_config
from swarm.errors import UsageError
from swarm.state import StateNames, TensorSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def find_checkpoint(source: Path, names: Optional[StateNames] = None) -> Checkpointer:
    """The checkpoint of `source`: a peer folder (its `checkpoint/`), a checkpoint folder (its latest), one
    round of it, or an old-format `checkpoint.pt`; UsageError naming `source` if it holds none."""
    if source.is_file() or (source / INDEX).is_file() and ROUND.fullmatch(source.name):
        return Checkpointer(source.parent, legacy_names=names, pinned=source)
    for folder in (source, source / "checkpoint"):
        found = Checkpointer(folder, legacy_names=names)
        if found.latest() is not None:
            return found
    raise UsageError(f"no complete checkpoint in {source} (looked for {source}/round-*/{INDEX}, "
                     f"{source}/checkpoint/round-*/{INDEX} and {legacy.FILENAME})")


def check_target(out: Path, dtype: str, force: bool) -> None:
    """Refuse, before any work, what `write_hf` would refuse."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(f"--hf-out {out} exists and is not empty (pass --force to replace it)")


def export_hf(source: Path, out: Path, dtype: str = "fp32", force: bool = False,
              config: Optional[str] = None) -> Path:
    """Write the Hugging Face folder `out` from the checkpoint of `source`; returns `out`."""
    from swarm.data import build_tokenizer

    check_target(out, dtype, force)
    checkpointer = find_checkpoint(source)
    try:
        meta = checkpointer.read_meta()
    except CorruptCheckpoint as e:
        raise UsageError(str(e)) from None
    where = checkpointer.latest()
    cfg = _config(meta, config, where)
    tokenizer = build_tokenizer(cfg.data)
    model = model_of(meta, cfg, tokenizer.vocab_size, where)
    load_global_parameters(find_checkpoint(source, StateNames.of(model)), model)
    return write_hf(model, tokenizer, out, dtype, force)


def _config(meta: dict[str, Any], path: Optional[str], where: Path) -> Config:
    if path is not None:
        return load_config(path)
    if "config" not in meta:
        raise UsageError(f"checkpoint {where} predates configs in checkpoints: pass the run's --config")
    return config_from_dict(meta["config"])


def model_of(meta: dict[str, Any], cfg: Config, vocab_size: int, where: Path) -> torch.nn.Module:
    """The model a checkpoint's parameters fit: from its Hugging Face config, else from the run's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = meta.get("hf_config")
    if hf is None:
        from swarm.model import build_model

        return build_model(cfg.model, vocab_size, cfg.data.tokenizer)
    try:
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"checkpoint {where} holds a model of type {hf.get('model_type')!r} that transformers "
                         f"cannot build as a causal LM: {str(e).splitlines()[0]}") from None


def load_global_parameters(checkpointer: Checkpointer, model: torch.nn.Module) -> None:
    """The checkpoint's global parameters into `model`'s trainable parameters, by name; UsageError naming the
    checkpoint and the first parameter that does not match (a checkpoint of another model)."""
    params = {f"global.{name}": p for name, p in model.named_parameters() if p.requires_grad}

    def destinations(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
        found = {s.name: s for s in specs if s.name.startswith("global.")}
        for name, p in params.items():
            if name not in found:
                raise ValueError(f"it has no {name} ({len(found)} global parameters, the model "
                                 f"{type(model).__name__} {len(params)})")
            if tuple(found[name].shape) != tuple(p.shape):
                raise ValueError(f"{name} has shape {tuple(found[name].shape)}, the model's {tuple(p.shape)}")
        if extra := [name for name in found if name not in params]:
            raise ValueError(f"{extra[0]} is no parameter of the model {type(model).__name__}")
        return {name: p.data for name, p in params.items()}

    try:
        with torch.no_grad():
            checkpointer.load(destinations)
    except CorruptCheckpoint as e:
        raise UsageError(str(e)) from None


def write_hf(model: torch.nn.Module, tokenizer, out: Path, dtype: str = "fp32", force: bool = False) -> Path:
    """`model` (its weights cast to `dtype`) and `tokenizer` as the Hugging Face folder `out`, whole or not at
    all; returns `out`."""
    check_target(out, dtype, force)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.sep_id
    model.generation_config.bos_token_id = None
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.to(DTYPES[dtype]).save_pretrained(partial, safe_serialization=True, max_shard_size="5GB")
        hf_tokenizer(tokenizer).save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def hf_tokenizer(tokenizer):
    """A `transformers` tokenizer that gives `tokenizer`'s ids: its own for a Hugging Face one; for byte tokens a
    byte-level BPE with no merges whose vocabulary is the 256 bytes, id = byte value (separator: byte 0)."""
    if hasattr(tokenizer, "hf"):
        return tokenizer.hf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    byte_level = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    sep = alphabet[tokenizer.sep_id]
    return PreTrainedTokenizerFast(tokenizer_object=byte_level, eos_token=sep, pad_token=sep,
                                   model_input_names=["input_ids", "attention_mask"])


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (what `ByteLevel` pre-tokenizes into)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def usage_snippet(out: Path) -> str:
    """Two lines of Python that load the exported model and generate text."""
    return (f'from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; '
            f'tok, model = T.from_pretrained("{out}"), M.from_pretrained("{out}")\n'
            f'print(tok.decode(model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=64)[0]))')
