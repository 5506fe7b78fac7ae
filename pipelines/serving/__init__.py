"""Multi-adapter serving with hot swap (issue #5 §3): `AdapterServer` in `router`."""

from pipelines.serving.router import AdapterServer

__all__ = ["AdapterServer"]
