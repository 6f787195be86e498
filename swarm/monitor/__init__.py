"""`swarm monitor`: watch a run from outside it (a read-only DHT client serving a web page, JSON and
Prometheus metrics). collect.py reads and remembers, render.py formats, page.py is the page, server.py
serves."""
