"""shardtensor: a distributed tensor with per-rank (uneven) sharding shapes."""


__all__: list[str] = []
