"""The DeepSpeed engines: the policy's, the reference policy, and the gathered weights that generation runs on."""
from __future__ import annotations

import collections
import contextlib

import torch

from grpo_recipe.config.schema import Config
from grpo_recipe.model.ds_config import ds_config
from grpo_recipe.model.load import load_model


def init_engine(model, cfg: Config, world_size: int):
    """The policy's engine; it owns the learning-rate schedule (stepped per optimizer step, checkpointed)."""
    import deepspeed

    from grpo_recipe.algo.schedule import lr_scheduler

    conf = ds_config(cfg, world_size, model.config.hidden_size)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=conf, lr_scheduler=lr_scheduler(cfg))
    share_fp32_master(engine)
    return engine


def share_fp32_master(engine) -> int:
    """Training in fp32, ZeRO-3's "fp32 master" partition is the parameter partition itself: make it so.

    DeepSpeed 0.19 means to (stage3.py, _create_fp32_partitions: "we don't need another copy of the weights"),
    but it compares `tensor.device == "cpu"`, which torch answers False, and clones: a whole extra copy of the
    rank's parameters (0.5x the model per rank at world 2). The optimizer keeps its tensor objects (its state is
    keyed by them); only their storage becomes the parameters'. Returns the bytes freed."""
    opt = getattr(engine, "optimizer", None)
    masters, params = getattr(opt, "fp32_partitioned_groups_flat", None), getattr(opt, "fp16_partitioned_groups_flat", None)
    if not masters or not params:
        return 0
    freed = 0
    for master, param in zip(masters, params):
        if master.dtype == param.dtype and master.device == param.device and master.shape == param.shape \
                and master.data_ptr() != param.data_ptr():
            freed += master.numel() * master.element_size()
            master.data = param.data
    return freed


def init_reference(path: str, cfg: Config, world_size: int, policy=None):
    """The starting policy for the KL term, called like a model.

    With LoRA: the policy engine itself with its adapter disabled (no second model). Otherwise a frozen copy,
    ZeRO-3 sharded like the policy, never given gradients.
    """
    import deepspeed

    if cfg.use_peft:
        from grpo_recipe.model.lora import ReferencePolicy

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


def _pairs(ref, policy) -> list:
    """(reference parameter, policy parameter) by name: the same model, sharded alike."""
    mine, theirs = dict(ref.module.named_parameters()), dict(policy.module.named_parameters())
    if mine.keys() != theirs.keys():
        raise RuntimeError("sync_ref_model: the reference and the policy have different parameters")
    return [(p, theirs[name]) for name, p in mine.items()]


@torch.no_grad()
def mix_into_reference(ref, policy, alpha: float) -> None:
    """TR-DPO's reference update (sync_ref_model, TRL's SyncRefModelCallback): ref = alpha x policy +
    (1 - alpha) x ref, every parameter. Under ZeRO-3 one parameter pair is gathered at a time (the whole model
    never is), every rank computes the same mix and rank 0's is partitioned back."""
    import deepspeed

    for target, source in _pairs(ref, policy):
        params = [p for p in (target, source) if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if params else None):
            target.data.mul_(1.0 - alpha).add_(source.data.to(target.dtype), alpha=alpha)


def _whole(p) -> bool:
    """Whether the parameter's whole tensor is in place on this rank: unpartitioned, or one ZeRO-3 keeps whole
    (persistent, small) once a forward has fetched it."""
    return not hasattr(p, "ds_tensor") or p.data.numel() == p.ds_numel


def reference_shard(ref) -> dict[str, torch.Tensor]:
    """This rank's part of a synced reference, for its checkpoint: each parameter's ZeRO-3 partition, and the
    whole tensors in place (`_whole`)."""
    shard = {}
    for name, p in ref.module.named_parameters():
        if hasattr(p, "ds_tensor"):
            shard[name] = p.ds_tensor.detach().cpu().clone()
        if _whole(p):
            shard[name + ":whole"] = p.data.detach().cpu().clone()
    return shard


@torch.no_grad()
def load_reference_shard(ref, shard: dict[str, torch.Tensor]) -> None:
    """The inverse of `reference_shard` on the same world size. A ZeRO-3 parameter not fetched yet needs only its
    partition: its first fetch gathers the whole from the partitions."""
    for name, p in ref.module.named_parameters():
        if hasattr(p, "ds_tensor"):
            p.ds_tensor.copy_(shard[name])
        if _whole(p):
            p.data.copy_(shard[name + ":whole"])


@contextlib.contextmanager
def released_gradients(engine):
    """ZeRO-3's gradient partition (a buffer the size of the rank's parameter shard) gives its memory back
    meanwhile, and comes back zeroed: between optimizer steps it holds nothing needed (the next step's first
    micro-batch overwrites it: stage3.py partition_grads, micro_step_id 0), so the whole gathered model fits in
    the room it leaves. Its views (one per parameter) keep their storage, which is resized, not replaced."""
    buf = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
    storage = buf.untyped_storage() if buf is not None else None
    # kept mid-accumulation, and when pinned for an offloaded optimizer (a storage that cannot be resized)
    if storage is None or not storage.resizable() or getattr(engine.optimizer, "micro_step_id", 0) != 0:
        yield
        return
    nbytes = storage.nbytes()
    storage.resize_(0)
    try:
        yield
    finally:
        storage.resize_(nbytes)
        buf.zero_()


@contextlib.contextmanager
def gathered_for_generation(engine, per_layer: bool = False):
    """The model to generate with.

    Default: all ZeRO-3 parameters gathered once, the modules' hooks set aside meanwhile, torch's own linear, and
    a LoRA adapter merged into the gathered weights; with the hooks in place every layer would be re-fetched and
    released at each decoding step (and a merge into weights that the hooks release is lost mid-forward).
    That needs the whole model on one device.

    `per_layer` (ZeRO-3, `hf_generation_gather: per_layer`): the hooks stay and gather each layer while it
    runs, at every decoding step: memory bounded by a few layers, for models that do not fit on one device.
    A LoRA adapter then runs unmerged (same function, a little slower). Every rank must run the same number
    of forwards (each one gathers): generate with synced_gpus.
    """
    import deepspeed

    from grpo_recipe.model.lora import merged_adapter  # a no-op without LoRA layers

    if per_layer and is_zero3(engine):
        yield engine.module
        return
    if not is_zero3(engine):
        with merged_adapter(engine.module) as model:
            yield model
        return
    with released_gradients(engine), \
            deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None), \
            _module_hooks_off(engine.module), torch_linear(), \
            merged_adapter(engine.module, restore=False) as model:
        yield model


@contextlib.contextmanager
def torch_linear():
    """torch's own F.linear meanwhile, in place of ZeRO-3's memory-efficient linear (an autograd Function per call),
    which `deepspeed.zero.Init` installs for the whole process: for generation, where nothing is differentiated
    (and CUDA vLLM compiles and captures its graphs through F.linear: it must see torch's)."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    zero3, plain = torch.nn.functional.linear, getattr(patcher, "linear_bk", torch.nn.functional.linear)
    torch.nn.functional.linear = plain
    try:
        yield
    finally:
        torch.nn.functional.linear = zero3


@contextlib.contextmanager
def _module_hooks_off(root):
    """The forward hooks of every module of `root` set aside, then put back as they were.

    DeepSpeed's own remove-and-register (`_remove_module_hooks`, `setup_zero_stage3_hooks`) renumbers the modules
    and so discards ZeRO-3's recorded module trace: the next micro-batch then fetches layer by layer, with no
    prefetch, and every rollout starts the trace over."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in root.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post
