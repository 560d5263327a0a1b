"""What the backends record into, below them: the ledger, call sites, the dispatch recorder."""
