"""One world of rank threads: its life (start, call, close), the baton scheduler, threads, doorbells."""
