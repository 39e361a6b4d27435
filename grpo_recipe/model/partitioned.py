"""Loading a model straight into its ZeRO-3 partitions: no rank ever holds the whole model.

The model is constructed under `deepspeed.zero.Init` (each parameter is partitioned the moment its module
exists, weight initialization skipped), then every rank copies only its own slice of each parameter from the
memory-mapped safetensors files. Pages of the mapped files are shared page cache, not private memory, and
a rank touches only the pages of its slices, so the private memory of loading is the rank's partitions:
1/world of the model. The values are the checkpoint's, exactly as `from_pretrained` loads them.

A hub name is loaded from its snapshot in the hub cache. What cannot be mapped one to one (no safetensors
files, a key the model does not have under any of its names, a shape that differs) goes through
transformers' own ZeRO-3 loading instead: also partitioned, but every rank reads the whole checkpoint and
each module is gathered while it is filled.
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def safetensors_files(folder: Path) -> list[Path] | None:
    """The checkpoint files of a local folder (sharded or not), or None when it has no safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


def local_folder(path: str) -> Path | None:
    """A local folder as is; a hub name as its snapshot in the hub cache (config and safetensors files,
    downloaded as from_pretrained would); None when neither works (transformers then says why)."""
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # any hub failure: from_pretrained reports it in its own words
        return None


@contextlib.contextmanager
def _no_weight_init():
    """transformers' switch for skipping random init (its location moved within 5.x)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


# safetensors dtype names -> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class MappedSafetensors:
    """One safetensors file, memory-mapped: flat slices of its tensors are views of the file's pages.

    The format is an 8-byte header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
    """

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
        n = int.from_bytes(self.map[:8], "little")
        self.header = {k: v for k, v in json.loads(self.map[8:8 + n]).items() if k != "__metadata__"}
        self.data_start = 8 + n

    def shape(self, key: str) -> tuple:
        return tuple(self.header[key]["shape"])

    def flat(self, key: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        meta = self.header[key]
        dtype = DTYPES[meta["dtype"]]
        count = math.prod(meta["shape"]) - start if count is None else count
        offset = self.data_start + meta["data_offsets"][0] + start * dtype.itemsize
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        self.map.close()


def _plan(model, files: list[MappedSafetensors]) -> tuple[dict, dict] | None:
    """(checkpoint key -> (file, parameter), checkpoint key -> (file, persistent buffer name)); a parameter
    is found under any of its tied names, with or without the base-model prefix. None when a parameter is
    missing, a shape differs or a dtype is not a plain one."""
    where = {k: f for f in files for k in f.header}
    if any(f.header[k]["dtype"] not in DTYPES for k, f in where.items()):
        return None
    prefix = getattr(model, "base_model_prefix", "") + "."
    names: dict[int, list[str]] = {}
    params = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    plan = {}
    for pid, aliases in names.items():
        key = next((c for n in aliases for c in (n, n.removeprefix(prefix), prefix + n) if c in where), None)
        p = params[pid]
        if key is None or where[key].shape(key) != tuple(p.ds_shape):
            return None
        plan[key] = (where[key], p)
    persistent = set(model.state_dict(keep_vars=True))
    buffers = {n: (where[n], n) for n, _ in model.named_buffers() if n in persistent and n in where}
    return plan, buffers


def _copy_partition(param, src: MappedSafetensors, key: str) -> None:
    """This rank's flat slice of the checkpoint tensor into param.ds_tensor (DeepSpeed's layout: equal
    partitions of the flattened tensor, the last one padded), read straight from the mapped file."""
    part = param.ds_tensor
    size = part.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    count = max(0, min(param.ds_numel - start, size))
    with torch.no_grad():
        if count > 0:
            part.narrow(0, 0, count).copy_(src.flat(key, start, count))
        if count < size:  # the alignment padding: deterministic rather than uninitialized
            part.narrow(0, count, size - count).zero_()


def _partitioning_init(ds_conf: dict, tied_head_shape: tuple | None):
    """`deepspeed.zero.Init` that leaves out two things loading does not need.

    Its broadcast of every new parameter from rank 0: that makes random initial values agree across ranks,
    but every value is overwritten from the checkpoint right after, and receiving it would materialize each
    whole parameter on every rank > 0 (the full embedding matrix, for one).

    Partitioning a Linear shaped like a tied output head (`tied_head_shape`): tie_weights() replaces its weight
    with the input embeddings' right after construction, and partitioning it first would fill a partition the
    size of the embeddings' for nothing (unpartitioned, its fresh weight is never touched, so never
    resident). Should such a Linear not be the head, it is partitioned after the tie.
    Falls back to the plain Init if DeepSpeed's internals moved.
    """
    import deepspeed

    class Init(deepspeed.zero.Init):
        def _zero_init_param(self, param):
            self._convert_to_deepspeed_param(param)
            param.partition()

        def _post_init_method(self, module):
            if not (isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) == tied_head_shape):
                super()._post_init_method(module)

    ok = all(hasattr(deepspeed.zero.Init, m) for m in ("_zero_init_param", "_convert_to_deepspeed_param",
                                                         "_post_init_method"))
    return (Init if ok else deepspeed.zero.Init)(config_dict_or_path=ds_conf)


def _tied_head_shape(hf_config) -> tuple | None:
    if getattr(hf_config, "tie_word_embeddings", False) and hasattr(hf_config, "vocab_size"):
        return hf_config.vocab_size, hf_config.hidden_size
    return None


def load_partitioned(path: str, ds_conf: dict, dtype: torch.dtype = torch.float32):
    """The model of `path`, constructed partitioned under ZeRO-3 (`ds_conf` stage 3) and filled from its
    checkpoint; each rank reads and keeps only its partitions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = local_folder(path)
    files = safetensors_files(folder) if folder is not None else None
    if files is not None:
        hf_config = AutoConfig.from_pretrained(folder)
        with _no_weight_init(), _partitioning_init(ds_conf, _tied_head_shape(hf_config)):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        model.tie_weights()  # part of the skipped init; from_pretrained ties after loading
        left = [p for p in model.parameters() if not hasattr(p, "ds_id")]
        if left:  # a Linear that looked like the head but was not tied
            next(p for p in model.parameters() if hasattr(p, "ds_id")).convert_to_zero_parameters(param_list=left)
        mapped = [MappedSafetensors(f) for f in files]
        try:
            planned = _plan(model, mapped)
            if planned is not None:
                plan, buffers = planned
                for key, (src, param) in plan.items():
                    _copy_partition(param, src, key)
                with torch.no_grad():
                    for key, (src, name) in buffers.items():  # buffers are not partitioned
                        buf = model.get_buffer(name)
                        buf.copy_(src.flat(key).view(buf.shape))
                return model
        finally:
            for m in mapped:
                m.close()
        del model
        warnings.warn(f"{path}: checkpoint keys do not map one to one onto the model's; loading through "
                      f"transformers' ZeRO-3 path (every rank reads the whole checkpoint)", stacklevel=2)
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_conf)  # transformers partitions while this object lives (a weak reference)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    finally:
        del keep
