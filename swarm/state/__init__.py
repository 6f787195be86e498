"""What a peer keeps and serves: its state as tensors, their hash, checkpoints, and models in and out.

- `peerstate.py`: a peer's state as named tensors plus a JSON header, and its `Position`; `statehash.py`: the one
  sha256 a peer records for each outer step it commits.
- `checkpoint.py`, `checkpoint_format.py`: checkpoints at round boundaries (resume by re-running);
  `shard_checkpoint.py`, `shard_state.py`: the same for a sharded peer, rank by rank.
- `tensorfile.py`: safetensors files written and read a tensor at a time.
- `export.py`: global parameters out as a Hugging Face model folder; `pretrained.py`: a warm start from one.
"""
