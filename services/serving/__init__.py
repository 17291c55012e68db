"""Serving and launch: the in-process engine, the role services' wiring, and `serve` as processes, on Ray or in
one process."""
