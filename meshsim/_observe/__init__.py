"""Observers: the ledger, the dispatch recorder, findings, traces, snapshots, call sites, the cost model."""
