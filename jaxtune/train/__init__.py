"""Training: the state and jitted step, checkpoints, metrics, and the loop that drives them."""
