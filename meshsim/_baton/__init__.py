"""Who may run: the baton scheduler (blocking waits, deadlock and timeout detection) and doorbells."""
