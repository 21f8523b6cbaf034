"""Training: the loop that drives a run (`loop.fine_tune`) and what it writes: checkpoints, metrics, trackers,
evaluations, exports. The train state and the step are the spine's (`jaxtune/spine/`)."""
