"""The in-memory c10d backend: process groups, one typed description per collective, rendezvous, movement."""
