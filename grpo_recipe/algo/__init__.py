"""The GRPO algorithm: log-probs, the loss types and advantages (loss.py, the only place that branches on
loss_type), the rank-local rollout buffer and its micro-batch plan (buffer.py), the update protocol
(update.py), the reuse rule of num_iterations: auto (reuse.py), the LR schedule (schedule.py), the phase clock
(clock.py). torch and config only: no DeepSpeed import, no files."""
