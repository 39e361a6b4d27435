"""Model loading, DeepSpeed initialization from ds_configs/, the reference policy, HF-format saving."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from recipe.config import Config, resolve_path
from recipe.launch import free_port


# ------------------------------------------------------------------------------------------
# process group
# ------------------------------------------------------------------------------------------
def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the launcher's process group (local.sh, the Slurm script, torchrun, deepspeed) or make a 1-rank one.

    Collectives give up after `timeout_s` (a stopped rank then ends the run, recipe/liveness.py); the store and
    the backend listen on the launcher's address only (recipe/rendezvous.py).
    """
    import datetime
    import warnings

    import deepspeed

    from recipe import liveness, rendezvous

    # torch deprecates the collective names DeepSpeed calls on every step; one warning per call floods logs.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    if "RANK" not in os.environ:  # plain `python -m recipe.train`: a world of one, with an in-memory store
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.update(rendezvous.backend_env(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from recipe.buildlock import load_comm_op

        load_comm_op()  # built once per environment under a lock that cannot go stale
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = rendezvous.store_for_rank(rank, world, timeout_s)
    if store is None:
        torch.distributed.init_process_group(backend, timeout=timeout)
    else:
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)  # wraps the group
    # a group left to interpreter teardown can abort the process ("terminate called without an active
    # exception") after its work is done; atexit runs this after liveness stops its heartbeat (registered later)
    atexit.register(_destroy_process_group)
    liveness.start(rank, world, timeout_s)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce_named(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named per-rank tensors (one dtype and device) summed over all ranks in ONE all-reduce: stacked in the
    dict's order, split back by name. A world of one (or no process group at all) skips the collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return values
    flat = torch.cat([v.reshape(-1) for v in values.values()])
    torch.distributed.all_reduce(flat)
    out, start = {}, 0
    for name, v in values.items():
        out[name] = flat[start:start + v.numel()].reshape(v.shape)
        start += v.numel()
    return out


def first_error(error: str | None) -> tuple[int, str] | None:
    """(rank, message) of the lowest rank that reports an error, the same on every rank; None when none does.
    Every rank must call it: a rank that failed must not just leave (the others would hang in their next
    collective, or lose the reason). One tiny all-reduce; the messages are gathered only after a failure."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world == 1:
        return None if error is None else (0, error)
    flag = torch.tensor([float(error is not None)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if not flag.item():
        return None
    errors = [None] * world
    torch.distributed.all_gather_object(errors, error)
    return next((r, e) for r, e in enumerate(errors) if e is not None)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def use_bf16(cfg: Config) -> bool:
    mode = str(cfg.bf16).lower()
    return torch.cuda.is_available() if mode == "auto" else mode == "true"


# ------------------------------------------------------------------------------------------
# model and tokenizer
# ------------------------------------------------------------------------------------------
def model_path(cfg: Config) -> str:
    if cfg.model_name_or_path.startswith("builtin:"):
        from recipe.tiny import ensure_builtin

        return str(ensure_builtin(cfg.model_name_or_path))
    p = resolve_path(os.path.expanduser(cfg.model_name_or_path))
    return str(p) if p.exists() else cfg.model_name_or_path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token: completions could never stop")
    return tok


def load_model(path: str, cfg: Config, world_size: int | None = None):
    """The model (with its LoRA adapter when use_peft), dropout off.

    With `world_size` (a process group is up) and a ZeRO-3 config it is constructed already partitioned for
    the engine of that world: each rank loads only its 1/world of the weights (with LoRA, of the base
    model; the small adapter is partitioned by deepspeed.initialize). Otherwise the whole model, as
    `from_pretrained` gives it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = None
    if world_size is not None:
        conf = ds_config(cfg, world_size, AutoConfig.from_pretrained(path).hidden_size)
    if conf is not None and conf["zero_optimization"].get("stage", 0) == 3:
        from recipe.partitioned_load import load_partitioned

        model = load_partitioned(path, conf)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # RL needs the training forward to see the same policy that sampled: no dropout.
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.use_peft:
        from recipe import lora

        model = lora.wrap(model, cfg)
    return model


# ------------------------------------------------------------------------------------------
# DeepSpeed
# ------------------------------------------------------------------------------------------
def ds_config(cfg: Config, world_size: int, hidden_size: int, train: bool = True) -> dict:
    """The JSON config with every batch, precision and optimizer field filled from the recipe's config."""
    conf = json.loads(resolve_path(cfg.deepspeed_config).read_text())
    conf["train_micro_batch_size_per_gpu"] = cfg.per_device_train_batch_size
    conf["gradient_accumulation_steps"] = cfg.gradient_accumulation_steps
    conf["train_batch_size"] = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size
    conf["gradient_clipping"] = cfg.max_grad_norm
    bf16 = use_bf16(cfg)
    conf["bf16"] = {**conf.get("bf16", {}), "enabled": bf16}
    conf["fp16"] = {**conf.get("fp16", {}), "enabled": False}
    zero = conf.setdefault("zero_optimization", {})
    auto = {"stage3_param_persistence_threshold": 10 * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "reduce_bucket_size": hidden_size * hidden_size,
            "allgather_bucket_size": hidden_size * hidden_size}  # ZeRO-2
    for key, value in auto.items():
        if zero.get(key) == "auto":
            zero[key] = value
    opt = conf.get("optimizer")
    if opt is not None:
        fill = {"lr": cfg.learning_rate, "betas": [cfg.adam_beta1, cfg.adam_beta2], "eps": cfg.adam_epsilon,
                "weight_decay": cfg.weight_decay}
        opt["params"] = {k: fill.get(k, v) if v == "auto" else v for k, v in opt.get("params", {}).items()}
        for k, v in fill.items():
            opt["params"].setdefault(k, v)
        # Fused and CPU Adam kernels compile for about a minute on CPU; torch's AdamW is as exact.
        if not torch.cuda.is_available() and opt.get("type", "").lower() in ("adam", "adamw"):
            opt["params"]["torch_adam"] = True
    if not train:
        for key in ("optimizer", "scheduler"):
            conf.pop(key, None)
        zero.pop("offload_optimizer", None)
        # ZeRO-1/2 shard optimizer state only and refuse a model without an optimizer: a frozen
        # reference model is then simply replicated (stage 0), as the policy's weights are.
        if zero.get("stage", 0) < 3:
            zero["stage"] = 0
    conf.setdefault("steps_per_print", 10**9)
    conf.setdefault("wall_clock_breakdown", False)
    return conf


def init_engine(model, cfg: Config, world_size: int):
    """The policy's engine; it owns the learning-rate schedule (stepped per optimizer step, checkpointed)."""
    import deepspeed

    from recipe.schedule import lr_scheduler

    conf = ds_config(cfg, world_size, model.config.hidden_size)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=conf, lr_scheduler=lr_scheduler(cfg))
    return engine


def init_reference(path: str, cfg: Config, world_size: int, policy=None):
    """The starting policy for the KL term, called like a model.

    With LoRA: the policy engine itself with its adapter disabled (no second model). Otherwise a frozen copy,
    ZeRO-3 sharded like the policy, never given gradients.
    """
    import deepspeed

    if cfg.use_peft:
        from recipe.lora import ReferencePolicy

        if policy is None:
            raise ValueError("init_reference: with use_peft the reference is the policy engine itself; pass it")
        return ReferencePolicy(policy)
    ref = load_model(path, cfg, world_size)
    ref.requires_grad_(False)
    conf = ds_config(cfg, world_size, ref.config.hidden_size, train=False)
    engine, *_ = deepspeed.initialize(model=ref, config=conf)
    engine.eval()
    return engine


def is_zero3(engine) -> bool:
    return engine.zero_optimization_partition_weights()


@contextlib.contextmanager
def gathered_for_generation(engine, per_layer: bool = False):
    """The model to generate with.

    Default: all ZeRO-3 parameters gathered once, with ZeRO's per-module hooks removed meanwhile, and a LoRA
    adapter merged into the gathered weights; with the hooks in place every layer would be re-fetched and
    released at each decoding step (and a merge into weights that the hooks release is lost mid-forward).
    That needs the whole model on one device.

    `per_layer` (ZeRO-3, `hf_generation_gather: per_layer`): the hooks stay and gather each layer while it
    runs, at every decoding step: memory bounded by a few layers, for models that do not fit on one device.
    A LoRA adapter then runs unmerged (same function, a little slower). Every rank must run the same number
    of forwards (each one gathers): generate with synced_gpus.
    """
    import deepspeed

    from recipe.lora import merged_adapter  # a no-op without LoRA layers

    if per_layer and is_zero3(engine):
        yield engine.module
        return
    if not is_zero3(engine):
        with merged_adapter(engine.module) as model:
            yield model
        return
    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        offload._remove_module_hooks()
        try:
            with merged_adapter(engine.module, restore=False) as model:
                yield model
        finally:
            offload.setup_zero_stage3_hooks()


def follow_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode the user's umask asks for: safetensors writes its
    weights 0600, everything else follows the umask, and a folder with mixed modes surprises whoever shares it."""
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def save_hf_model(engine, tokenizer, out_dir: Path, rank: int, save_merged: bool = False) -> None:
    """Gather the ZeRO-3 weights layer by layer onto rank 0 and write an HF folder atomically.

    With LoRA, out_dir gets the adapter in peft's format (only the adapter is gathered), and with save_merged
    also OUT_DIR-merged the full model with the adapter merged in.
    """
    from recipe import lora

    peft = lora.is_peft(engine.module)
    if peft:
        state = lora.adapter_state(engine, rank)
    else:
        state = engine._zero3_consolidated_16bit_state_dict() if is_zero3(engine) else engine.module.state_dict()
    if rank != 0:
        return
    _write_atomically(out_dir, lambda tmp: (engine.module.save_pretrained(tmp, state_dict=state),
                                            tokenizer.save_pretrained(tmp)))
    if peft and save_merged:
        merged = lora.merged_model(engine.module, out_dir)
        _write_atomically(out_dir.with_name(out_dir.name + "-merged"),
                          lambda tmp: (merged.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def _write_atomically(out_dir: Path, write) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    follow_umask(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
