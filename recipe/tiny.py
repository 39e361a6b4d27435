"""A tiny Qwen2-architecture model and byte-level BPE tokenizer, built offline and cached on disk.

`model_name_or_path: builtin:tiny-qwen2` resolves to this folder, so the quickstart and the tests need
no network. Head size 32 (hidden 128, 4 heads) so vLLM's CPU attention supports it too. A smaller
sibling, builtin:tiny-qwen2-h64 (hidden 64), is the model of the reuse benchmarks' TRL-comparable regime.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# name -> (hidden size, MLP size, attention heads, key/value heads); same tokenizer for all
BUILTIN_MODELS = {"builtin:tiny-qwen2": (128, 256, 4, 2), "builtin:tiny-qwen2-h64": (64, 128, 2, 1)}
VERSION = "v1"  # bump when the recipe below changes, so stale caches are not reused
CORPUS = Path(__file__).parent / "data" / "tldr_prompts.jsonl"
# Qwen2's own pre-tokenization: AutoTokenizer loads a folder with a qwen2 config.json as Qwen2Tokenizer,
# which installs this pipeline; training with it keeps the token ids identical after reloading.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
EOS = "<|endoftext|>"


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_RECIPE_CACHE", Path.home() / ".cache" / "grpo_recipe"))


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.read_text().splitlines()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, padding_side="left",
                                   model_max_length=1024)


def build_model(tokenizer, seed: int = 0, shape: tuple = BUILTIN_MODELS["builtin:tiny-qwen2"]):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    eos = tokenizer.convert_tokens_to_ids(EOS)
    hidden, intermediate, heads, kv_heads = shape
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def ensure_builtin(name: str) -> Path:
    """The cached folder for a built-in model, built once (atomically: temp folder, then rename)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}")
    target = cache_root() / f"{name.split(':', 1)[1]}-{VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tok = build_tokenizer()
    build_model(tok, shape=BUILTIN_MODELS[name]).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another rank won the race with identical content
        shutil.rmtree(tmp, ignore_errors=True)
    return target
