"""Tokens for training and eval, and which of them each peer reads.

- `tokens.py`: a corpus prepared once into token files that every peer memory-maps, named by its content hash.
- `batches.py`: tokenizers, the train and eval streams, per-peer shards of fixed-size windows.
- `embedded.py`: the embedded corpus (corpus/: CPython 3.11.7's standard library source, pinned).
- `peerdata.py`: one peer's data position; `leases.py`: which shard a peer of a swarm trains on (pure).
"""
