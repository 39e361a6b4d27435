"""Large-model paths on real gloo ranks: partitioned loading, per-layer generation, bf16 training; config errors."""
import pytest
import torch
from conftest import REPO, torchrun
from dist_update import BASE, local_buffer
from test_update import ref_logps

from grpo_recipe.algo.update import forward_logps
from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.model.load import load_model
from grpo_recipe.run.preflight import check_bf16, preflight

QUICKSTART = str(REPO / "grpo_recipe/configs/quickstart.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-rank run of tests/dist_scale.py (about 35 s), shared by the tests below."""
    out = tmp_path_factory.mktemp("scale") / "scale.pt"
    torchrun(2, ["tests/dist_scale.py", str(out)])
    return {**torch.load(out, weights_only=True), "out_dir": out.parent}


@pytest.mark.slow
def test_partitioned_loading_gives_todays_weights_and_no_rank_holds_the_model(run, tiny_model_dir):
    assert run["world"] == 2 and run["partitioned_on_every_rank"]
    for peft in (False, True):
        # today's loading: from_pretrained of the whole model (then the LoRA wrap), in one process
        today = load_model(str(tiny_model_dir), Config(**{**BASE, "use_peft": peft, "lora_r": 4, "lora_alpha": 8}))
        got = run["loading"]["zero3_lora" if peft else "zero3"]["state"]
        want = dict(today.named_parameters())
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k].detach()) for k in want), f"use_peft={peft}: weights differ"
    assert run["loading"]["zero3_offload"]["engine_ok"]
    # a checkpoint without safetensors files (transformers' ZeRO-3 loading), and Linears shaped like a tied
    # head that are not one (partitioned after the tie): same weights
    want = dict(load_model(str(tiny_model_dir), Config(**BASE)).named_parameters())
    for case in ("bin", "square_heads"):
        assert all(torch.equal(run["loading"][case]["state"][k], v.detach()) for k, v in want.items()), case


def test_hub_name_resolves_to_its_cached_snapshot(tmp_path, monkeypatch):
    from grpo_recipe.model.partitioned import local_folder, safetensors_files

    snap = tmp_path / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    import huggingface_hub.constants as hc  # read at import: point the real hub client at this cache, offline

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert local_folder("org/tiny") == snap and safetensors_files(snap) == [snap / "model.safetensors"]
    assert local_folder("org/not-cached") is None
    assert local_folder(str(snap)) == snap


@pytest.mark.slow
def test_per_layer_generation_gives_the_same_tokens_with_a_fraction_gathered(run):
    for rank, g in enumerate(run["generation_per_rank"]):
        assert g["full"]["greedy"] == g["per_layer"]["greedy"], f"rank {rank}: greedy tokens differ"
        assert g["full"]["sampled"] == g["per_layer"]["sampled"], f"rank {rank}: sampled tokens differ"
        assert len(g["full"]["sampled"]) == 4 * (1 + rank % 2)  # the ranks generated different amounts
        # full: the whole model gathered at once; per_layer: never more than the largest module (embeddings)
        assert g["full"]["peak_live_numel"] == g["total_numel"]
        assert 0 < g["per_layer"]["peak_live_numel"] <= 0.2 * g["total_numel"]


@pytest.mark.slow
def test_bf16_trains_with_fp32_log_probs_close_to_the_fp32_run(run):
    fp32, bf16 = run["bf16"]["fp32"], run["bf16"]["bf16"]
    assert bf16["param_dtype"] == "torch.bfloat16" and fp32["param_dtype"] == "torch.float32"
    assert bf16["logp_dtype"] == "torch.float32" and bf16["old_logps_dtype"] == "torch.float32"
    a, b = fp32["old_logps"], bf16["old_logps"]
    known = ~torch.isnan(a)
    assert torch.equal(known, ~torch.isnan(b)) and known.any()
    diff = (a[known] - b[known]).abs().max().item()
    assert 0 < diff < 0.02, f"bf16 log-probs should differ from fp32 by bf16 rounding only, got {diff}"
    # step 1's loss is -mean(A) whatever the model (ratio 1); step 2 runs on weights that bf16 updated
    assert len(bf16["losses"]) == 2 and all(torch.isfinite(torch.tensor(bf16["losses"])))
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(torch.tensor(bf16["grad_norm"]), torch.tensor(fp32["grad_norm"]), rtol=2e-2, atol=0)


@pytest.mark.parametrize("args, message, caught_by", [
    (["--hf_generation_gather", "sometimes"], "hf_generation_gather: must be full or per_layer", "fields"),
    (["--hf_generation_gather", "per_layer", "--generation_backend", "vllm"],
     "hf_generation_gather: per_layer applies to generation_backend: hf", "fields"),
    (["--hf_generation_gather", "per_layer", "--deepspeed_config", "ds_configs/zero2.json"],
     "hf_generation_gather: per_layer needs a ZeRO-3 deepspeed_config", "preflight"),
])
def test_bad_scaling_config_is_named(args, message, caught_by):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(["--config", QUICKSTART, *args])
        assert caught_by == "preflight", "the fields alone should have been refused"
        preflight(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bf16_on_a_gpu_without_it_is_named():
    check_bf16(cuda=False, supported=False, device_name="")  # CPUs emulate bf16
    check_bf16(cuda=True, supported=True, device_name="NVIDIA H200")
    with pytest.raises(ConfigError, match=r"^bf16: true, but Tesla V100-SXM2-32GB has no bf16 support"):
        check_bf16(cuda=True, supported=False, device_name="Tesla V100-SXM2-32GB")


@pytest.mark.parametrize("peft", [False, True])
def test_forward_logps_equal_the_full_logits_computation(tiny_model_dir, peft):
    """Logits for completion positions only, selective log-softmax: the same log-probs as the whole sequence's
    logits upcast to fp32 (plain PyTorch), also through a LoRA model, and the same gradients."""
    cfg = Config(**{**BASE, "use_peft": peft, "lora_r": 4, "lora_alpha": 8})
    model = load_model(str(tiny_model_dir), cfg)
    if peft:  # a non-zero adapter, so that it matters
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    buf = local_buffer(Config(**BASE), 0, 1)
    idx = torch.arange(len(buf))
    mb = buf.micro_batch(idx)
    got = forward_logps(model, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1], 1.0)
    want = ref_logps(model, buf, idx)
    mask = mb["completion_mask"]
    torch.testing.assert_close(got * mask, want * mask, atol=1e-5, rtol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad((got * mask).sum(), params)
    g_want = torch.autograd.grad((want * mask).sum(), params)
    assert max((a - b).abs().max().item() for a, b in zip(g_got, g_want)) < 1e-5


@pytest.mark.slow
def test_the_fp32_master_is_the_parameter_partition_and_the_final_save_goes_shard_by_shard(run, tmp_path):
    """Training in fp32, a rank holds its parameter partition once (DeepSpeed would clone it as the "fp32
    master", engine.share_fp32_master); the final model is written a shard at a time and loads as the weights."""
    from transformers import AutoModelForCausalLM

    mem = run["memory"]
    assert mem["master_shared"]
    final = run["out_dir"] / "final"
    shards = sorted(p.name for p in final.glob("model-*.safetensors"))
    assert len(shards) > 2 and (final / "model.safetensors.index.json").is_file() and not (final.parent / "final.tmp").exists()
    loaded = dict(AutoModelForCausalLM.from_pretrained(final).named_parameters())
    assert loaded.keys() >= mem["gathered"].keys()
    assert all(torch.equal(loaded[k].detach(), v) for k, v in mem["gathered"].items())
