"""Prompt datasets (prompts.py): loading any format `datasets` reads, the chat template, left truncation, the
rank's shard and the epoch order. Imports config and algo."""
