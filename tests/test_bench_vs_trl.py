"""bench/vs_trl.py without TRL (it is an optional extra): its CLI, its clear failure when trl is missing, the
TRL batch-shape mapping, the prompt file both sides get, and the arithmetic that turns logs into figures."""
from __future__ import annotations

import json
import subprocess
import sys
import venv

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import vs_trl  # noqa: E402
import vs_trl_logs as logs  # noqa: E402

SCRIPT = REPO / "bench" / "vs_trl.py"


def quickstart(*overrides: str):
    args = vs_trl.parse_args([x for kv in overrides for x in ("--set", kv)])
    return vs_trl.recipe_config(args)


def test_help():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "--mus" in out.stdout and "trl" in out.stdout


def test_missing_trl_fails_at_once_with_how_to_install(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a real interpreter with no packages: no trl
    out = subprocess.run([sys.executable, str(SCRIPT), "--python", str(bare / "bin" / "python"), "--out",
                          str(tmp_path / "res")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    assert "trl is not installed" in out.stderr and "bench-trl" in out.stderr
    assert not (tmp_path / "res").exists()  # nothing ran


@pytest.mark.parametrize("spg", [1, 3])
def test_trl_batch_shape_matches_the_recipe(spg):
    cfg = quickstart(f"optimizer_steps_per_pass={spg}", "per_device_train_batch_size=4")
    world, mu = 2, 4
    f = vs_trl.trl_fields(cfg, mu, max_steps=40, cuda=False)
    # TRL 1.16 (GRPOConfig.__post_init__): generation_batch_size = per_device x world x steps_per_generation, one
    # optimizer step = per_device x grad_accum micro-batch rows per rank, and a new generation every
    # steps_per_generation x num_iterations micro-steps.
    generation_batch = f["per_device_train_batch_size"] * world * f["steps_per_generation"]
    assert generation_batch == cfg.completions_per_rollout * world
    assert f["per_device_train_batch_size"] * f["gradient_accumulation_steps"] == \
        cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    micro_steps_per_rollout = f["steps_per_generation"] * f["num_iterations"]
    assert micro_steps_per_rollout // f["gradient_accumulation_steps"] == mu * cfg.optimizer_steps_per_pass
    assert f["num_generations"] == cfg.num_generations and f["max_completion_length"] == cfg.max_completion_length
    assert f["lr_scheduler_type"] == "constant" and f["use_vllm"] is False and f["bf16"] is False
    assert f["gradient_checkpointing"] is False and f["save_strategy"] == "no"


def test_steps_are_whole_rollouts_and_at_least_two():
    assert vs_trl.steps_for(24, 1) == 24
    assert vs_trl.steps_for(22, 4) == 24
    assert vs_trl.steps_for(3, 4) == 8


def test_prompt_file_is_the_recipes_truncation(tmp_path):
    from grpo_recipe.data.prompts import PromptStream, load_prompt_dataset
    from grpo_recipe.model.load import load_tokenizer
    from grpo_recipe.model.source import model_path

    cfg = quickstart("max_prompt_length=64")
    tok = load_tokenizer(model_path(cfg))
    n = vs_trl.write_prompts(cfg, tok, tmp_path / "p.jsonl")
    texts = [json.loads(line)["prompt"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert n == len(texts) == 73
    # What the recipe feeds the model for the original file == plain tokenization of the written text (what TRL
    # does with it), for every prompt of the first epoch.
    stream = PromptStream(load_prompt_dataset(cfg), tok, cfg, rank=0, world_size=1)
    seen = set()
    for rollout in range(-(-n // cfg.prompts_per_rollout)):
        for i, ids in zip(stream.indices(rollout), stream.batch(rollout).prompt_ids):
            assert tok(texts[i])["input_ids"] == ids
            seen.add(i)
    assert seen == set(range(n))
    assert max(len(tok(t)["input_ids"]) for t in texts) == 64


def test_ds_config_for_trl_is_the_recipes_file_with_torch_adam():
    from grpo_recipe.model.ds_config import ds_config

    cfg = quickstart()
    raw = json.loads((REPO / cfg.deepspeed_config).read_text())
    ours = ds_config(cfg, 2, hidden_size=128)
    trl = vs_trl.trl_ds_config(cfg, cuda=False, ours=ours)
    assert trl["optimizer"]["params"].pop("torch_adam") is True
    assert trl["optimizer"]["params"].pop("fused") is True  # as the recipe runs it on CPU (model/ds_config.py)
    # the "auto" fields accelerate does not fill get the recipe's values; the rest stay for accelerate to fill
    filled = {k for k, v in raw["zero_optimization"].items() if v == "auto" and k not in vs_trl.ACCELERATE_FILLS}
    assert filled == {"stage3_max_live_parameters", "stage3_max_reuse_distance"}
    for k in filled:
        assert trl["zero_optimization"].pop(k) == ours["zero_optimization"][k]
        raw["zero_optimization"].pop(k)
    assert trl == raw
    # --trl_zero recipe: every ZeRO "auto" field gets the recipe's value
    same = vs_trl.trl_ds_config(cfg, cuda=False, ours=ours, all_zero=True)["zero_optimization"]
    autos = [k for k, v in json.loads((REPO / cfg.deepspeed_config).read_text())["zero_optimization"].items()
             if v == "auto"]
    assert len(autos) == 5 and all(same[k] == ours["zero_optimization"][k] for k in autos)
    ours = {"train_batch_size": 32, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1280}}
    other = {"train_batch_size": 32, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100000}}
    assert vs_trl.ds_differences(ours, ours) == []
    assert vs_trl.ds_differences(ours, other) == [
        "zero_optimization.stage3_param_persistence_threshold: ours 1280 vs TRL 100000"]


def test_steady_rates_skip_the_first_rollout():
    ends = [5.0, 6.0, 7.0, 8.0, 10.0, 11.0, 12.0, 13.0, 15.0, 16.0, 17.0, 18.0]  # 3 rollouts of 4 steps
    step_s, rollout_s = logs.steady_rates(ends, 4)
    assert step_s == pytest.approx((18.0 - 8.0) / 8) and rollout_s == pytest.approx(5.0)
    with pytest.raises(ValueError):
        logs.steady_rates(ends[:4], 4)  # one rollout: nothing left after warm-up
    with pytest.raises(ValueError):
        logs.steady_rates(ends[:10], 4)  # a partial rollout


def test_reward_at_budget_is_the_mean_of_the_last_rollouts_within_it():
    times, rewards = [1.0, 2.0, 3.0, 4.0, 5.0], [-9.0, -8.0, -6.0, -3.0, -1.0]
    assert logs.reward_at_budget(times, rewards, 4.5) == pytest.approx((-8.0 - 6.0 - 3.0) / 3)
    assert logs.reward_at_budget(times, rewards, 1.5) == -9.0
    assert logs.reward_at_budget(times, rewards, 0.5) is None


def test_read_trl_combines_ranks_and_functions(tmp_path):
    def line(**e):
        return json.dumps(e) + "\n"

    for rank, (m1, m2) in enumerate([(-10.0, -6.0), (-20.0, -8.0)]):
        ev = [line(event="train_begin", t=100.0)]
        ev += [line(event="generate", t=100.5, seconds=0.5)]
        ev += [line(event="rewards", t=101.0, func="length", weight=1.0, n=16, mean=m1),
               line(event="rewards", t=101.0, func="bonus", weight=0.5, n=16, mean=2.0)]
        ev += [line(event="step_end", t=102.0, step=1), line(event="step_end", t=103.0, step=2)]
        ev += [line(event="generate", t=103.4, seconds=0.4), line(event="prepare", t=103.6, seconds=0.6)]
        ev += [line(event="forward", t=104.2, seconds=0.2), line(event="backward", t=104.5, seconds=0.3)]
        ev += [line(event="forward", t=105.2, seconds=0.2), line(event="backward", t=105.8, seconds=0.5)]
        ev += [line(event="rewards", t=104.0, func="length", weight=1.0, n=16, mean=m2),
               line(event="rewards", t=104.0, func="bonus", weight=0.5, n=16, mean=4.0)]
        ev += [line(event="step_end", t=105.0, step=3), line(event="step_end", t=106.0, step=4)]
        (tmp_path / f"events-rank{rank}.jsonl").write_text("".join(ev))
    (tmp_path / "log_history.json").write_text(json.dumps([{"step": 1}, {"step": 4}]))
    got = logs.read_trl(tmp_path, steps_per_rollout=2, world=2)
    assert got["step_ends"] == [2.0, 3.0, 5.0, 6.0]
    assert got["rollout_times"] == [2.0, 5.0]
    assert got["rollout_rewards"] == pytest.approx([-15.0 + 1.0, -7.0 + 2.0])
    assert got["generations"] == 2 and got["optimizer_steps"] == 4 and got["trainer_global_step"] == 4
    assert got["completions_per_generation"] == [32] and got["generate_s"] == [0.5, 0.4]
    # rank 0's calls after the first rollout (steps 3 and 4: 3 s), per step; the rest of the step is `other`
    assert got["phases"] == pytest.approx({"generate": 0.2, "prepare": 0.3, "forward": 0.2, "backward": 0.4,
                                           "other": 0.6, "step": 1.5})


def test_summary_without_a_scored_rollout_on_one_side_says_none():
    """A short run (CI's 2-step smoke) can end before TRL's first step does: no reward within the budget there."""
    def run(impl, at_budget):
        return {"impl": impl, "mu": 1, "rep": 0, "sec_per_step": 2.0, "sec_per_rollout": 2.0, "generate_s_median": 1.0,
                "rollout_rewards": [-10.0, -9.0], "budget_s": 3.0, "reward_at_budget": at_budget}

    summary = logs.summarize([run("ours", -9.5), run("trl", None)], [1])
    w = summary["by_mu"]["1"]["reward_at_budget"]
    assert w["ours"] == -9.5 and w["trl"] is None and w["ratio"] is None and w["difference"] is None
    assert summary["step_time_ratio"] == 1.0
    assert "| n/a | n/a | n/a |" in logs.markdown_table(summary)
