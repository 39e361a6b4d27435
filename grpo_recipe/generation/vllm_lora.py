"""How a policy's weights reach the colocated vLLM engine, full fine-tune or LoRA (`vllm_lora_sync`).

- Full fine-tune, and LoRA `merged`: every parameter, gathered from its ZeRO-3 shards a chunk at a time, streamed
  into vLLM in ONE `reload_weights` call. A LoRA layer's base weight goes as W + (alpha / r) B A, computed on
  the gathered copies, which ZeRO-3 throws away on release: the engine's own parameters are never written, so
  there is no merge/unmerge drift.
- LoRA `adapter`: only the adapter's A and B tensors are gathered and registered, in memory, in vLLM's own LoRA
  manager under a new id (so no cache can mix two versions); vLLM runs the frozen base plus the adapter.
  A LoRA layer on a vocabulary matrix (`lm_head`, `embed_tokens`) is written merged instead, straight into
  that vLLM layer: vLLM's LoRA cannot adapt those for every model (Qwen2 in vllm 0.32: only the linears).

A LoRA layer on a tied weight (the tiny model's `lm_head` shares the input embeddings) needs its own matrix in
vLLM: the engine then runs untied (`tie_word_embeddings: false`), gets the merged head under `lm_head` and the
untouched embeddings, and starts from the training engine's weights (a dummy load, then one full load).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from grpo_recipe.model.lora import is_peft, lora_layers

ADAPTER = "default"  # peft's adapter name; the recipe trains one adapter
PEFT_PREFIX = "base_model.model."
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32 LoRAConfig.max_lora_rank choices


def hf_name(peft_name: str) -> str:
    """A peft-wrapped parameter's name in the plain model (the name vLLM's loader knows)."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


# ------------------------------------------------------------------------------------------
# engine options
# ------------------------------------------------------------------------------------------
def vocab_layer_names(model) -> set[str]:
    """LoRA layers on the input or output embedding matrix (written merged in adapter mode)."""
    vocab = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return {name for name, layer, _ in lora_layers(model) if id(layer) in vocab}


def llm_options(cfg, model) -> dict:
    """Extra LLM(...) arguments for this policy: LoRA slots in adapter mode, untied embeddings where needed."""
    if not (cfg.use_peft and is_peft(model)):
        return {}
    opts = {}
    if cfg.vllm_lora_sync == "adapter":
        opts.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                    max_lora_rank=next(r for r in MAX_LORA_RANKS if r >= cfg.lora_r))
    if needs_untied(model):
        opts.update(hf_overrides={"tie_word_embeddings": False}, load_format="dummy")
    return opts


def needs_untied(model) -> bool:
    return is_peft(model) and any(tied for _, _, tied in lora_layers(model))


# ------------------------------------------------------------------------------------------
# gathered weights, merged where asked
# ------------------------------------------------------------------------------------------
def gathered_weights(engine, chunk_numel: int, merge: Callable[[str], bool] = lambda layer: True,
                     only: set[str] | None = None, counter: list | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter vLLM loads, gathered from the ZeRO-3 shards a chunk at a time.

    A LoRA layer travels as one unit (base weight, bias, A, B gathered together); its base weight is yielded as
    W + delta when `merge(layer name)`, computed out of place on the gathered copies; A and B themselves are
    not yielded. `only`: just these LoRA layers. Every rank walks the same order (the gathers are collective).
    Clones, because a gathered parameter is released to its shard when its chunk's context exits. A tied
    parameter is yielded under each of its names: vLLM reloads layer by layer and would put the old tensor back
    into a layer that got nothing. `counter[0]` accumulates the bytes yielded.
    """
    model = engine.module
    layers = {name: layer for name, layer, _ in lora_layers(model)} if is_peft(model) else {}
    units: dict = defaultdict(lambda: ([], []))  # owner (a LoRA layer's name, or a parameter) -> (params, names)
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next((n for n in layers if name.startswith(n + ".")), None)
        if only is not None and owner not in only:
            continue
        params, names = units[owner or id(p)]
        if all(q is not p for q in params):
            params.append(p)
        if ".lora_" not in name:
            names.append((name, owner))
    for group in _chunks(list(units.values()), chunk_numel):
        with _gathered([p for params, _ in group for p in params]):
            for _, names in group:
                for name, owner in names:
                    value = _param(model, name)
                    if owner is not None and name == f"{owner}.base_layer.weight" and merge(owner):
                        value = value + layers[owner].get_delta_weight(ADAPTER).to(value.dtype)
                    else:
                        value = value.clone()
                    if counter is not None:
                        counter[0] += value.numel() * value.element_size()
                    yield hf_name(name), value


def adapter_tensors(engine, chunk_numel: int, skip: set[str], counter: list) -> dict[str, torch.Tensor]:
    """The adapter's A and B, gathered (a chunk at a time), under the names peft saves them with."""
    named = [(n, p) for n, p in engine.module.named_parameters()
             if ".lora_" in n and not any(n.startswith(s + ".") for s in skip)]
    out = {}
    for group in _chunks([([p], [n]) for n, p in named], chunk_numel):
        with _gathered([p for params, _ in group for p in params]):
            for (p,), (n,) in group:
                out[n.replace(f".{ADAPTER}.", ".")] = p.data.clone()
                counter[0] += p.numel() * p.element_size()
    return out


def _chunks(units: list, chunk_numel: int) -> Iterator[list]:
    """Consecutive units whose parameters add up to about chunk_numel elements (bounded gathers)."""
    chunk, numel = [], 0
    for unit in units:
        chunk.append(unit)
        numel += sum(getattr(p, "ds_numel", p.numel()) for p in unit[0])
        if numel >= chunk_numel:
            yield chunk
            chunk, numel = [], 0
    if chunk:
        yield chunk


@contextlib.contextmanager
def _gathered(params: list):
    """The full tensors of `params` (each once) on every rank; released to their shards on exit."""
    import deepspeed

    unique = list({id(p): p for p in params}.values())
    with deepspeed.zero.GatheredParameters(unique, modifier_rank=None), torch.no_grad():
        yield


def _param(model, name: str) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr).data


# ------------------------------------------------------------------------------------------
# adapter mode: vLLM's own LoRA, fed from memory
# ------------------------------------------------------------------------------------------
def _runner(worker):
    return getattr(worker, "worker", worker).model_runner


def _expected_modules(worker) -> set[str]:
    """Module names vLLM's LoRA can adapt in this model (its packed layers spelled out, as in vLLM's loader)."""
    manager = _runner(worker).lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    return {m for module in manager.supported_lora_modules for m in packed.get(module, [module])}


def _install(worker, tensors: dict, lora_id: int, r: int, alpha: float, vocab: dict) -> None:
    """Replace vLLM's adapter by `tensors` (peft names) under `lora_id`; write merged vocabulary matrices."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    runner = _runner(worker)
    manager = runner.lora_manager
    helper = PEFTHelper.from_dict({"r": r, "lora_alpha": alpha, "target_modules": []})
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype)
    manager.remove_all_adapters()
    manager._adapter_manager.add_adapter(lora)  # registered now, activated by the next request that names it
    model = runner.get_model()
    for name, full in vocab.items():
        layer = model.get_submodule(name.rpartition(".")[0])
        layer = getattr(layer, "base_layer", layer)
        layer.weight_loader(layer.weight, full)  # this rank's vocabulary shard
        layer.quant_method.process_weights_after_loading(layer)  # CPU kernels use a repacked copy of the weight


class AdapterSync:
    """Adapter mode: per sync, the adapter's tensors (and merged vocabulary matrices, if adapted) into vLLM."""

    def __init__(self, llm, engine, cfg):
        self.llm, self.cfg = llm, cfg
        self.vocab = vocab_layer_names(engine.module)
        self.request, self.lora_id = None, 0  # None: the adapter still starts as a no-op (B = 0)
        self.servable = llm.collective_rpc(_expected_modules)[0]
        names = {n.rsplit(".", 1)[-1] for n, _, _ in lora_layers(engine.module) if n not in self.vocab}
        self.unservable = sorted(names - self.servable)  # the generator refuses to start with any

    def load(self, engine, chunk_numel: int) -> int:
        """Collective. Returns the bytes handed to vLLM."""
        from vllm.lora.request import LoRARequest

        counter = [0]
        tensors = adapter_tensors(engine, chunk_numel, self.vocab, counter)
        vocab = dict(gathered_weights(engine, chunk_numel, only=self.vocab, counter=counter)) if self.vocab else {}
        self.lora_id += 1  # a new id per version: nothing cached for an older adapter can be reused
        self.llm.collective_rpc(_install, args=(tensors, self.lora_id, self.cfg.lora_r, self.cfg.lora_alpha, vocab))
        self.request = LoRARequest(f"policy-{self.lora_id}", self.lora_id, f"in-memory:policy-{self.lora_id}")
        return counter[0]
