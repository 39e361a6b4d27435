"""The model: where it comes from, a folder, a hub name or a built-in tiny model (source.py, tiny.py); loading it,
partitioned for ZeRO-3 (load.py, partitioned.py) and with LoRA (lora.py); the DeepSpeed engines and the reference
policy (engine.py); saving HF-format weights (save.py). Imports config, dist and algo."""
