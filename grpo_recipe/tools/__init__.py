"""The command-line programs (also console scripts): evaluate a saved model (evaluate.py, grpo-evaluate), export a
checkpoint to an HF folder (export.py, grpo-export), prepare a model (prepare_model.py, grpo-prepare-model) or a
reasoning-gym dataset (prepare_data.py, grpo-prepare-data), rebuild the shipped GSM8K-like file
(make_gsm8k_like.py)."""
