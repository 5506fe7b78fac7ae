"""Stages composed end to end: the one place below the DAGs that says "train, evaluate, register, gate"."""
