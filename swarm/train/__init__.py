"""One peer's training: the two-level loop and what it is made of.

- `trainer.py`: the DiLoCo loop for one peer, top to bottom: rounds, H inner steps each, then the outer step.
- `inner.py`: the inner loop's pieces, plain PyTorch (AdamW, its schedule, one inner step); `model.py`: the model.
- `diloco.py`: the outer step, attached at the optimizer boundary; `fragments.py`: Streaming DiLoCo's fragments.
- `averaging.py`: the interface through which the trainer averages a pseudo-gradient (swarm/net implements it);
  `overlap.py`: an exchange running behind the next round's first inner steps (`diloco.delay`).
- `trainer_state.py`: the state a trainer serves and takes; `history.py`: what its rounds leave behind.
- `ranks.py`, `sharding.py`: a peer of several processes (DDP; FSDP2 with sharded outer state).
- `accounting.py`: memory and round-time accounting from a config and the model's shapes.
"""
