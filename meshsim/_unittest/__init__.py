"""torch's distributed unittest bases and decorators, on simulated ranks."""
