"""The parts of a training run around the loop: preflight checks that ask the machine (preflight.py), the output
folder (outdir.py), checkpoints (checkpoint.py), metrics and completion samples (metrics.py), trackers
(trackers.py), evaluation during training (evaluation.py). Imports every folder below it."""
