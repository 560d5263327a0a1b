"""What a process owns and rank threads share: the hand-over registry, patches, per-thread c10d worlds."""
