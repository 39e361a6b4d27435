"""The DeepSpeed configs in ds_configs/: every one is filled by the recipe and gives the reference update."""
import json

import pytest
from conftest import REPO
from dist_update import BASE
from test_update import max_diff, reference_update, run_cases

from grpo_recipe.config.schema import Config
from grpo_recipe.model.ds_config import ds_config

CONFIGS = sorted(p.name for p in (REPO / "ds_configs").glob("*.json"))


def leaves(d):
    for v in d.values():
        yield from leaves(v) if isinstance(v, dict) else [v]


@pytest.mark.parametrize("name", CONFIGS)
def test_recipe_fills_every_auto_field(name):
    cfg = Config(deepspeed_config=f"ds_configs/{name}", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 learning_rate=3e-4, max_grad_norm=0.5)
    for train in (True, False):
        conf = ds_config(cfg, world_size=3, hidden_size=128, train=train)
        assert "auto" not in list(leaves(conf)), f"{name}: 'auto' left in {conf}"
        assert conf["train_batch_size"] == 4 * 2 * 3 and conf["gradient_clipping"] == 0.5
        assert conf["bf16"]["enabled"] is False  # CPU: fp32
    # The frozen reference model: no optimizer, and replicated (stage 0) below ZeRO-3.
    assert "optimizer" not in conf and "offload_optimizer" not in conf["zero_optimization"]
    assert conf["zero_optimization"]["stage"] in (0, 3)


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_adam_is_torchs_fused_adamw_on_every_device_so_nothing_is_compiled(name, cuda, monkeypatch, tmp_path):
    """DeepSpeed's FusedAdam (nvcc at the first GPU run) and CPUAdam (a C++ build) are never asked for; a config
    that names torch_adam itself keeps its choice."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    cfg = Config(deepspeed_config=f"ds_configs/{name}", bf16="false")
    params = ds_config(cfg, world_size=2, hidden_size=64)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    own = json.loads((REPO / "ds_configs" / name).read_text())
    own["optimizer"]["params"]["torch_adam"] = False
    (tmp_path / name).write_text(json.dumps(own))
    params = ds_config(Config(deepspeed_config=str(tmp_path / name), bf16="false"), 2, 64)["optimizer"]["params"]
    assert params["torch_adam"] is False and "fused" not in params


def test_every_config_file_is_plain_json_with_a_zero_stage():
    assert {"zero2.json", "zero3.json", "zero3_offload.json"} <= set(CONFIGS)
    for name in CONFIGS:
        conf = json.loads((REPO / "ds_configs" / name).read_text())
        assert conf["zero_optimization"]["stage"] in (1, 2, 3), name


@pytest.mark.slow
def test_zero2_and_offload_give_the_single_process_reference_update(tmp_path, tiny_model_dir):
    """Two ranks, mu = 2, two steps per rollout, KL to the reference model: same weights as plain PyTorch."""
    case = {"loss_type": "grpo", "num_iterations": 2, "optimizer_steps_per_pass": 2, "gradient_accumulation_steps": 2,
            "beta": 0.1}
    cases = [{"name": n, "deepspeed_config": f"ds_configs/{n}.json", **case} for n in ("zero2", "zero3_offload")]
    got = run_cases(tmp_path, 2, cases, "ds_configs")
    expected, _ = reference_update(tiny_model_dir, Config(**{**BASE, **case}), world=2)
    assert got["zero2"]["zero"] == {"stage": 2, "offload_param": False, "offload_optimizer": False}
    assert got["zero3_offload"]["zero"] == {"stage": 3, "offload_param": True, "offload_optimizer": True}
    for name in ("zero2", "zero3_offload"):
        diff = max_diff(got[name]["state"], expected)
        assert diff < 1e-5, f"{name}: 2-rank weights differ from the reference by {diff}"
