"""`swarm export`: a peer's committed global parameters as a Hugging Face model folder.

    swarm export runs/<run>/peer-0 --hf-out model      # or a checkpoint folder, or one round of it

The source is a peer's last complete checkpoint (swarm/state/checkpoint.py: checkpoints are renamed into place whole,
and a reader keeps what it opened even if the peer prunes it, so a peer that is still training can be exported).
The model is built from the checkpoint's meta, on the meta device (names, shapes and config, no weights): the
model's Hugging Face config (`hf_config`), or for older checkpoints the run's config (`config`; the oldest,
without either: pass `--config`). Its weights are the checkpoint's `global.<param>` tensors, the parameters the
swarm committed, by name (the rest of the checkpoint is not read), each read from its pieces (whatever ranks
wrote them), cast and written in turn: the exporter holds one tensor at a time, never the model.
`swarm export --from-swarm RUN` takes them from the swarm instead (peers/export_swarm.py). Written by `write_hf`:
`config.json`, `model.safetensors` (sharded above 5 GB, with the index and names of `save_pretrained`),
`generation_config.json` and the tokenizer, a Hugging Face tokenizer's own files or, for byte tokens, a
byte-level tokenizer with no merges that `AutoTokenizer` loads and that gives the same ids. The folder appears
whole or not at all: it is written beside the target and renamed into place.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from swarm.config import Config
from swarm.errors import UsageError
from swarm.run.configfile import config_from_dict, load_config
from swarm.state import tensorfile
from swarm.state.checkpoint import INDEX, ROUND, Checkpointer, CorruptCheckpoint
from swarm.state.peerstate import TensorSpec
from swarm.state.tensorfile import ITEMSIZE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


def find_checkpoint(source: Path) -> Checkpointer:
    """The checkpoint of `source`: a peer folder (its `checkpoint/`), a checkpoint folder (its latest) or one
    round of it; UsageError naming `source` if it holds none."""
    if (source / INDEX).is_file() and ROUND.fullmatch(source.name):
        return Checkpointer(source.parent, pinned=source)
    for folder in (source, source / "checkpoint"):
        found = Checkpointer(folder)
        if found.latest() is not None:
            return found
    raise UsageError(f"no complete checkpoint in {source} (looked for {source}/round-*/{INDEX}, "
                     f"{source}/checkpoint/round-*/{INDEX})")


def check_target(out: Path, dtype: str, force: bool) -> None:
    """Refuse, before any work, what `write_hf` would refuse."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UsageError(f"--hf-out {out} exists and is not empty (pass --force to replace it)")


def export_hf(source: Path, out: Path, dtype: str = "fp32", force: bool = False,
              config: Optional[str] = None) -> Path:
    """Write the Hugging Face folder `out` from the checkpoint of `source`; returns `out`."""
    from swarm.data.batches import build_tokenizer

    check_target(out, dtype, force)
    checkpointer = find_checkpoint(source)
    try:
        meta = checkpointer.read_meta()
    except CorruptCheckpoint as e:
        raise UsageError(str(e)) from None
    where = checkpointer.latest()
    cfg = _config(meta, config, where)
    tokenizer = build_tokenizer(cfg.data)
    with torch.device("meta"):  # names, shapes and config only: the weights come from the checkpoint one at a time
        model = model_of(meta, cfg, tokenizer.vocab_size, where)
    weights = global_parameters(find_checkpoint(source), model)
    try:
        return write_hf(model, tokenizer, out, dtype, force, weights)
    except CorruptCheckpoint as e:
        raise UsageError(str(e)) from None


def _config(meta: dict[str, Any], path: Optional[str], where: Path) -> Config:
    if path is not None:
        return load_config(path)
    if "config" not in meta:
        raise UsageError(f"checkpoint {where} predates configs in checkpoints: pass the run's --config")
    return config_from_dict(meta["config"])


def model_of(meta: dict[str, Any], cfg: Config, vocab_size: int, where: Path) -> torch.nn.Module:
    """The model a checkpoint's parameters fit, on the meta device (shapes only): from its Hugging Face config, else
    from the run's config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = meta.get("hf_config")
    if hf is None:
        from swarm.train.model import build_model

        return build_model(cfg.model, vocab_size, cfg.data.tokenizer, "meta")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"checkpoint {where} holds a model of type {hf.get('model_type')!r} that transformers "
                         f"cannot build as a causal LM: {str(e).splitlines()[0]}") from None


def hf_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a Hugging Face folder holds of `model`: its parameters by name, a tied one once (under its first
    name, as `save_pretrained` writes it; loading ties it again). UsageError for a model with persistent buffers,
    which a checkpoint (global parameters only) cannot give."""
    params = dict(model.named_parameters())
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if buffers := [name for name in model.state_dict() if name not in aliases]:
        raise UsageError(f"cannot export {type(model).__name__}: its buffer {buffers[0]} is saved with the model, "
                         "and checkpoints hold only its parameters")
    return params


def global_parameters(checkpointer: Checkpointer, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's global parameters of `model`, one at a time (name, tensor) in the order of
    `hf_parameters(model)`; CorruptCheckpoint naming the checkpoint and the first parameter that does not match
    (a checkpoint of another model) before any is read."""
    params = hf_parameters(model)

    def wanted(specs: list[TensorSpec]) -> list[str]:
        found = {s.name: s for s in specs if s.name.startswith("global.")}
        for name, p in params.items():
            if f"global.{name}" not in found:
                raise ValueError(f"it has no global.{name} ({len(found)} global parameters, the model "
                                 f"{type(model).__name__} {len(params)})")
            if tuple(found[f"global.{name}"].shape) != tuple(p.shape):
                raise ValueError(f"global.{name} has shape {tuple(found[f'global.{name}'].shape)}, the model's "
                                 f"{tuple(p.shape)}")
        if extra := [name for name in found if name.removeprefix("global.") not in params]:
            raise ValueError(f"{extra[0]} is no parameter of the model {type(model).__name__}")
        return [f"global.{name}" for name in params]

    for name, tensor in checkpointer.each(wanted):
        yield name.removeprefix("global."), tensor
        del tensor  # before the next one is read


def write_hf(model: torch.nn.Module, tokenizer, out: Path, dtype: str = "fp32", force: bool = False,
             weights: Optional[Iterator[tuple[str, torch.Tensor]]] = None,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """`model` and `tokenizer` as the Hugging Face folder `out`, whole or not at all; returns `out`. `weights`:
    the model's parameters (name, tensor) in the order of `hf_parameters(model)`, each cast to `dtype` and
    written as it comes, so that no more than one of them is held here (a model built on the meta device gives
    only the names, shapes and config); None: the model's own. Weights above `max_shard_bytes` are sharded."""
    check_target(out, dtype, force)
    params = hf_parameters(model)
    weights = iter(params.items()) if weights is None else weights
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.sep_id
    model.generation_config.bos_token_id = None
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        config = copy.deepcopy(model.config)
        config.architectures, config.dtype = [type(model).__name__], DTYPES[dtype]
        config.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        stored = str(DTYPES[dtype]).removeprefix("torch.")  # "float32", as swarm/state/tensorfile.py names dtypes
        _write_weights(partial, [(name, stored, tuple(p.shape)) for name, p in params.items()], weights,
                       DTYPES[dtype], max_shard_bytes)
        hf_tokenizer(tokenizer).save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _write_weights(folder: Path, specs: list[tuple[str, str, tuple[int, ...]]],
                   weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, max_shard_bytes: int) -> None:
    """`model.safetensors`, or above `max_shard_bytes` `model-0000k-of-0000n.safetensors` and their index (the
    names `save_pretrained` gives), from `weights` as they come."""
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = total = 0
    for spec in specs:
        nbytes = math.prod(spec[2]) * ITEMSIZE[spec[1]]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size, total = size + nbytes, total + nbytes

    def next_weight(name: str) -> torch.Tensor:
        got, tensor = next(weights)
        if got != name:
            raise ValueError(f"weights came out of order: {got}, expected {name}")
        return tensor.to(dtype)

    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        with open(folder / name, "wb") as f:
            tensorfile.write_each(f, shard, next_weight, {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {spec[0]: name for name, shard in zip(names, shards) for spec in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


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
