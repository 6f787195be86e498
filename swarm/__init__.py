"""swarm: DiLoCo training across peers connected by the ordinary internet, on hivemind."""

__version__ = "0.1.0"
