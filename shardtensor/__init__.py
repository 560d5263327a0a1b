"""shardtensor: a distributed tensor with per-rank (uneven) sharding shapes."""

from __future__ import annotations

__all__: list[str] = []
