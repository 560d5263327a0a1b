"""How one test body runs on N ranks: thread ranks, spawned processes, torchrun; per-rank fixtures."""
