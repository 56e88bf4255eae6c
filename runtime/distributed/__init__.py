"""Serving beyond one process: one engine over several processes (`multiprocess.py`, its
start-up handshake `join.py`, its frames `wire.py`: `--nnodes`), and replicas of an engine
behind one front (`replicas.py`, `front.py`: `--data-parallel-size`)."""
