"""A tiny Qwen2-architecture model and byte-level BPE tokenizer, built offline and cached on disk.

`model_name_or_path: builtin:tiny-qwen2` resolves to this folder, so the quickstart and the tests need
no network. Head size 32 (hidden 128, 4 heads) so vLLM's CPU attention supports it too. A smaller
sibling, builtin:tiny-qwen2-h64 (hidden 64), is the model of the reuse benchmarks' TRL-comparable regime.
builtin:tiny-qwen2-tools speaks ChatML with tool calls (the shipped chatml_tools templates, <|im_end|> ending a
turn) and is warmed up on grpo_recipe/assets/tool_demos.jsonl (model/sft.py): the multi-turn quickstarts' model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# name -> (hidden size, MLP size, attention heads, key/value heads); one tokenizer for the plain ones, the tools
# model's adds ChatML's special tokens
BUILTIN_MODELS = {"builtin:tiny-qwen2": (128, 256, 4, 2), "builtin:tiny-qwen2-h64": (64, 128, 2, 1),
                  "builtin:tiny-qwen2-tools": (128, 256, 4, 2)}
ASSETS = Path(__file__).parents[1] / "assets"
# builtin:tiny-qwen2-tools: its warm-up (steps, learning rate) on the demos; enough to follow the turn format
# loosely, so that its runs still have something to learn
TOOLS_WARMUP = (150, 3e-3)
CHATML = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
VERSION = "v1"  # bump when the recipe below changes, so stale caches are not reused
CORPUS = Path(__file__).parents[1] / "assets" / "tldr_prompts.jsonl"
# Qwen2's own pre-tokenization: AutoTokenizer loads a folder with a qwen2 config.json as Qwen2Tokenizer,
# which installs this pipeline; training with it keeps the token ids identical after reloading.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
EOS = "<|endoftext|>"


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_RECIPE_CACHE", Path.home() / ".cache" / "grpo_recipe"))


def build_tokenizer(vocab_size: int = 512, chatml: bool = False):
    """The byte-level BPE tokenizer; `chatml`: with ChatML's turn markers and tool-call tags as special tokens,
    <|im_end|> as EOS, and the shipped tool-calling chat and response templates."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS] + (CHATML if chatml else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.read_text().splitlines()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>" if chatml else EOS, pad_token=EOS,
                                   padding_side="left", model_max_length=1024)
    if chatml:
        import json

        fast.chat_template = (ASSETS / "chatml_tools.jinja").read_text()
        fast.response_template = json.loads((ASSETS / "chatml_tools_response.json").read_text())
    return fast


def build_model(tokenizer, seed: int = 0, shape: tuple = BUILTIN_MODELS["builtin:tiny-qwen2"]):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    eos = tokenizer.eos_token_id
    hidden, intermediate, heads, kv_heads = shape
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def missing_files(folder: Path) -> list[str]:
    """What a usable model folder lacks: a parseable config, readable weights, the tokenizer files."""
    import json

    from safetensors import safe_open

    missing = []
    try:  # `architectures` is how AutoModel users (TRL, vLLM) pick the class
        if not json.loads((folder / "config.json").read_text()).get("architectures"):
            missing.append("config.json's architectures")
    except (OSError, ValueError):
        missing.append("config.json")
    try:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            if not list(f.keys()):
                missing.append("model.safetensors (empty)")
    except Exception:  # safetensors raises its own error types for a torn or foreign file
        missing.append("model.safetensors")
    missing += [n for n in ("tokenizer.json", "tokenizer_config.json") if not (folder / n).is_file()]
    return missing


def save_model(model, folder: Path) -> None:
    """Config and weights written by this process whatever its rank (transformers' save_pretrained writes
    them only on rank 0 once a process group exists; the tokenizer it writes everywhere)."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # save_pretrained would add it; config alone does not
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    state, seen = {}, set()
    for key, tensor in model.state_dict().items():  # a tied weight under its first name (the embeddings), as
        if tensor.data_ptr() not in seen:           # transformers and vLLM expect it
            seen.add(tensor.data_ptr())
            state[key] = tensor.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def ensure_builtin(name: str) -> Path:
    """The cached folder for a built-in model, built once per machine.

    One process builds (under an OS lock that dies with it), the others wait and reuse the result. A folder is
    used only when complete (config, weights, tokenizer); an incomplete one, e.g. from an older recipe or an
    interrupted build, is rebuilt. The build goes to a temporary folder renamed into place when complete.
    """
    from grpo_recipe.dist.buildlock import exclusive, say

    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}")
    target = cache_root() / f"{name.split(':', 1)[1]}-{VERSION}"
    if not missing_files(target):
        return target
    with exclusive(target.with_name(target.name + ".lock"), f"the build of {name} in {target}"):
        missing = missing_files(target)
        if not missing:
            return target  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        tools = name == "builtin:tiny-qwen2-tools"
        tok = build_tokenizer(chatml=tools)
        model = build_model(tok, shape=BUILTIN_MODELS[name])
        if tools:
            warm_up_on_tool_demos(model, tok, say)
        save_model(model, tmp)
        tok.save_pretrained(tmp)
        if missing_files(tmp):
            raise RuntimeError(f"building {name} in {tmp} left out {', '.join(missing_files(tmp))}")
        if target.exists():
            say(f"rebuilding {target}: it lacks {', '.join(missing)}")
            stale = target.with_name(f"{target.name}.stale-{os.getpid()}")
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, target)
    return target


def warm_up_on_tool_demos(model, tok, say) -> None:
    import json

    import torch

    from grpo_recipe.model.sft import warm_up

    demos = [json.loads(line) for line in (ASSETS / "tool_demos.jsonl").read_text().splitlines()]
    steps, lr = TOOLS_WARMUP
    say(f"warming builtin:tiny-qwen2-tools up on {len(demos)} tool-use conversations ({steps} steps)")
    with torch.random.fork_rng():  # the caller's random state is not the warm-up's business
        warm_up(model, tok, demos, steps, lr, seed=0)
