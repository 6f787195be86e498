"""Warm start: a run that starts from the weights of a Hugging Face model folder (`model.pretrained`).

    swarm peer --config configs/tiny.yaml --model.pretrained model     # e.g. a folder `swarm export` wrote

Each peer builds its model from its own copy of the folder, wherever it lies: `model.pretrained` is a per-peer
key (config.PER_PEER_KEYS; `swarm join RUN --model.pretrained DIR`). What the peers of a run share instead is
the folder's content hash (`pretrained_sha256`: its config.json and the bytes of its weight files, not its
path), part of the run's identity (swarm/run/runid.py `weights_sha256`, its manifest, its fingerprint): a folder
with other weights is another run, and a joiner of a warm-started run that names no folder is told to pass
one. Nothing is downloaded: the folder must be on disk, with a config.json and weights (`check_folder`), and
the model's embedding must fit the tokenizer (`load`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Optional

from swarm.config import Config, ModelConfig
from swarm.errors import UsageError

WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")  # weight files and their shard indexes
NOT_CONTENT = ("transformers_version", "_name_or_path")  # config.json keys about the writer, not the model
PADDING = 512  # an embedding may have up to this many rows more than the tokenizer has tokens (padding)
PIECE = 2**24
log = logging.getLogger(__name__)


def check_folder(path: str | Path) -> Path:
    """`path` as a Hugging Face model folder (config.json naming a model type, weight files); UsageError naming
    it otherwise."""
    folder = Path(path).expanduser()
    what = f"model.pretrained {path}"
    if not folder.is_dir():
        raise UsageError(f"{what}: no such folder (a Hugging Face model folder, e.g. one `swarm export` wrote)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{what} is not a Hugging Face model folder: its config.json does not read "
                         f"({type(e).__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UsageError(f"{what} is not a Hugging Face model folder: its config.json names no model_type")
    if not _weight_files(folder):
        raise UsageError(f"{what} is not a Hugging Face model folder: it holds no weights (*.safetensors, *.bin)")
    return folder


def _weight_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in WEIGHTS for p in folder.glob(pattern) if p.is_file()})


def pretrained_sha256(path: str | Path) -> str:
    """The content hash of the model folder `path`: its config.json (less the keys that name the writer) and the
    bytes of its weight files, by name. The same for every copy of the folder wherever it lies. Computed once
    while the files keep their sizes and modification times, and remembered across starts (`remembered`): a
    30B folder is 120 GB to read, minutes at every start otherwise."""
    folder = check_folder(path)
    files = [folder / "config.json", *_weight_files(folder)]
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digest(str(folder.resolve()), stamp)


def remembered() -> Path:
    """The file that remembers weight hashes by folder and stamp: $XDG_CACHE_HOME/swarm/weights-sha256.json (by
    default ~/.cache/swarm/). A folder whose files were written to since has another stamp and is hashed again,
    as swarm/data/tokens.py does for token files."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm" / "weights-sha256.json"


def _recall(key: str) -> Optional[str]:
    try:
        found = json.loads(remembered().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and len(found) == 64 else None


def _remember(key: str, sha256: str) -> None:
    path = remembered()
    try:
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known = {**(known if isinstance(known, dict) else {}), key: sha256}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dict(list(known.items())[-64:]), indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only home: hashed again at the next start, never trusted unhashed
        log.warning("cannot remember the hash of %s in %s: %s", key, path, e)


@functools.lru_cache(maxsize=8)
def _digest(folder: str, stamp: tuple) -> str:
    key = json.dumps([folder, stamp])
    if (known := _recall(key)) is not None:
        return known
    digest = hashlib.sha256()
    config = json.loads((Path(folder) / "config.json").read_text())
    digest.update(json.dumps({k: v for k, v in config.items() if k not in NOT_CONTENT}, sort_keys=True).encode())
    for name, size, _ in stamp[1:]:
        digest.update(f"\0{name}\0{size}\0".encode())
        with open(Path(folder) / name, "rb") as f:
            while piece := f.read(PIECE):
                digest.update(piece)
    _remember(key, digest.hexdigest())
    return digest.hexdigest()


def check(cfg: Config) -> None:
    """Refuse, before anything starts, a `model.pretrained` that is not a Hugging Face model folder."""
    if cfg.model.pretrained is not None:
        check_folder(cfg.model.pretrained)


def load(cfg: ModelConfig, vocab_size: int, tokenizer: str, device="cpu", shard=None):
    """The model of the folder `cfg.pretrained`, in fp32, on `device`; UsageError if it does not load or if its
    embedding does not fit `tokenizer`'s `vocab_size` tokens (as many rows, or up to PADDING more). `shard`
    (swarm/train/model.py): the model is built on the meta device and sharded first, then each rank reads one
    tensor at a time and keeps its rows, from safetensors files or from `torch.save` zip files (*.bin, through a
    memory map); only a *.bin of torch's legacy format (no zip) is loaded whole, then sharded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = check_folder(cfg.pretrained)
    files = sorted(folder.glob("*.safetensors")) or sorted(p for p in folder.glob("*.bin") if zipfile.is_zipfile(p))
    on_meta = shard is not None and bool(files)
    try:
        if not on_meta:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot load model.pretrained {cfg.pretrained}: {str(e).splitlines()[0]}") from None
    rows = model.get_input_embeddings().num_embeddings
    if not vocab_size <= rows < vocab_size + PADDING:
        raise UsageError(f"model.pretrained {cfg.pretrained} has {rows} embedding rows and data.tokenizer "
                         f"{tokenizer!r} {vocab_size} tokens: they must agree (a tokenizer of that model)")
    if shard is not None:
        shard(model)
    if on_meta:
        _read_rows(model, files, cfg.pretrained, device)
    return model


def _read_rows(model, files: list[Path], where: str, device) -> None:
    """Each parameter of `model` (on the meta device, sharded) from the weight `files` (safetensors, or torch.save
    zips), a tensor at a time: a rank reads only its rows of it (`WeightFiles.rows`), cast to fp32."""
    from swarm.train.model import fill_rows, materialize

    with WeightFiles(files, where) as weights:
        materialize(model, device)
        fill_rows(model, weights.rows)


class WeightFiles:
    """The weight files of a checkpoint, each opened once for as long as the `with` block lasts (a torch.save zip's
    index is unpickled once, not once per tensor): any stored tensor's rows, by name."""

    def __init__(self, files: list[Path], where: str):
        self.files, self.where = files, where
        self._stack = contextlib.ExitStack()
        self._located: dict[str, tuple[Path, Any]] = {}  # tensor name -> its file and the file opened

    def __enter__(self) -> WeightFiles:
        with self._stack:
            for path in self.files:
                f = self._stack.enter_context(_open(path))
                self._located.update({key: (path, f) for key in f.keys()})
            self._stack = self._stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._located = {}
        self._stack.close()

    def rows(self, name: str, shape, rows: slice):
        """Rows `rows` (of dim 0) of tensor `name`, in fp32, reading no other rows: a safetensors slice, or rows of
        a memory-mapped torch.save zip (only their pages are read); UsageError naming the tensor if the files hold
        none of that name, or one whose shape is not `shape`."""
        if name not in self._located:
            raise UsageError(f"model.pretrained {self.where} holds no tensor {name}")
        path, f = self._located[name]
        if path.suffix == ".safetensors":
            piece = f.get_slice(name)
            found = tuple(piece.get_shape())
        else:
            piece = f.get_tensor(name)
            found = tuple(piece.shape)
        if found != tuple(shape):
            raise UsageError(f"model.pretrained {self.where}: tensor {name} is {found}, the model's {tuple(shape)}")
        return piece[rows].float()


def _open(path: Path):
    """A weight file read a tensor at a time: safetensors' own reader, or a torch.save zip (*.bin) mapped into
    memory (`torch.load(mmap=True)`), whose pages are read as a tensor is, and unmapped when the file closes."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        return safe_open(path, framework="pt")
    return _MappedZip(path)


class _MappedZip:
    def __init__(self, path: Path):
        self.path, self.tensors = path, None

    def __enter__(self) -> _MappedZip:
        import torch
        try:
            self.tensors = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except (RuntimeError, OSError, ValueError) as e:
            raise UsageError(f"model.pretrained: {self.path} does not load: {str(e).splitlines()[0]}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.tensors = None

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str):
        return self.tensors[name]
