"""The pytest plugin, one module per feature."""
