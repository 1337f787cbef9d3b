"""Training and inference backends."""
