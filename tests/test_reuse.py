"""Reuse decisions: the pass-level rule (fixed targets and num_iterations: auto), and in real runs: passes skipped once
the policy drifted, g measured and frozen identically on every rank, and resumes that repeat every decision."""
import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist
from conftest import REPO, torchrun

from grpo_recipe.algo.reuse import ReuseController, drift_rate, squared_updates
from grpo_recipe.config.schema import Config
from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.checkpoint import safe_load
from grpo_recipe.run.metrics import read_jsonl

RUN = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "6",
       "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_completion_length", "16",
       "--disable_tqdm", "true"]
TIMING = ("time", "tokens_per_s", "step_time", "step_cpu")


def run(*args):
    proc = subprocess.run([sys.executable, *RUN, *args], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def strip(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def step(rollout, kl=0.0, clip=0.0, tokens=100, gen=0.0, train=0.0, it=0, decode=100.0, size=1000, zero_std=0.0):
    """A metrics record as the loop logs it, with what the controller reads."""
    return {"generation": rollout, "iteration": it, "approx_kl": kl, "clip_ratio_region": clip, "train_tokens": tokens,
            "time_sync_s": 0.0, "time_generate_s": gen, "time_score_s": 0.0, "time_old_logp_s": 0.0,
            "time_train_s": train, "decode_steps": decode, "rollout_tokens": size, "frac_reward_zero_std": zero_std}


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fixed_targets_decide_per_pass_on_token_weighted_means():
    ctl = ReuseController(Config(num_iterations=4, reuse_target_kl=0.01))
    assert not ctl.step_done(step(0, kl=0.0), last_in_pass=False)
    assert ctl.step_done(step(0, kl=0.03), last_in_pass=True)  # mean 0.015 > 0.01
    assert not ctl.step_done(step(1, kl=0.005, clip=0.9, tokens=10), last_in_pass=True)  # reset; clip not a target
    clip = ReuseController(Config(num_iterations=4, reuse_max_clip_fraction=0.1))
    assert clip.step_done(step(0, kl=9.0, clip=0.2, tokens=5), last_in_pass=True)
    off = ReuseController(Config(num_iterations=4))
    assert not off.enabled and not off.step_done(step(0, kl=9.0), last_in_pass=True)


def test_auto_replays_while_the_next_pass_drift_is_below_the_target_set_by_g():
    # g = 0.8: a replay pays while it is worth more than 0.2 of a fresh pass, 1 - KL / KL_max > 0.2: KL < 0.8 KL_max
    ctl = ReuseController(Config(num_iterations="auto", reuse_generation_share=0.8, reuse_max_kl=5e-3))
    assert ctl.enabled and ctl.target_kl == pytest.approx(4e-3)
    assert not ctl.step_done(step(0, kl=0.0, it=0), last_in_pass=True)  # on-policy: the first replay is free
    # KL grows like the updates squared: after pass 1 the next pass runs at about 4x, after pass 2 at 2.25x
    assert not ctl.step_done(step(0, kl=0.9e-3, it=1), last_in_pass=True)  # next ~3.6e-3
    assert ctl.step_done(step(0, kl=1.1e-3, it=1), last_in_pass=True)  # next ~4.4e-3
    assert not ctl.step_done(step(0, kl=1.7e-3, it=2), last_in_pass=True)  # next ~3.8e-3
    assert ctl.step_done(step(0, kl=1.8e-3, it=2), last_in_pass=True)  # next ~4.05e-3
    # two steps per pass: pass 0 saw 0 and 1 updates (KL ~ 0 + 1), pass 1 will see 2 and 3 (4 + 9)
    assert drift_rate(1e-4, 0, 2) * squared_updates(1, 2) == pytest.approx(13e-4) and drift_rate(0.0, 0, 1) is None
    low = Config(num_iterations="auto", reuse_generation_share=0.2, reuse_max_kl=5e-3)
    assert ReuseController(low).target_kl == pytest.approx(1e-3)
    # however dear generation is, a replay never runs past KL_max: its worth is zero there
    dear = Config(num_iterations="auto", reuse_generation_share=0.999, reuse_max_kl=5e-3)
    assert 4.99e-3 < ReuseController(dear).target_kl < 5e-3
    unknown = ReuseController(Config(num_iterations="auto"))
    assert unknown.target_kl == Config().reuse_max_kl / 2  # before g is known: g = 1/2


def test_auto_never_replays_a_rollout_whose_groups_all_have_equal_rewards():
    # every advantage 0: the policy loss has no gradient, so a replay is worth nothing whatever its drift
    ctl = ReuseController(Config(num_iterations="auto", reuse_generation_share=0.9))
    assert ctl.step_done(step(0, kl=0.0, it=0, zero_std=1.0), last_in_pass=True)
    assert not ctl.step_done(step(1, kl=0.0, it=0, zero_std=0.75), last_in_pass=True)  # one group of 4 teaches
    # a fixed mu is the user's: its passes are all taken (its targets alone may cut them)
    fixed = ReuseController(Config(num_iterations=4, reuse_target_kl=1e-3))
    assert not fixed.step_done(step(0, kl=0.0, it=0, zero_std=1.0), last_in_pass=True)


def test_smoothed_drift_rate_keeps_a_strong_rollouts_replays_and_follows_a_lasting_change():
    # target 4e-3; after pass 1 a replay is taken while 4 x rate < 4e-3: rate < 1e-3 (pass 1 saw one update)
    cfg = dict(num_iterations="auto", reuse_generation_share=0.8, reuse_max_kl=5e-3)
    alone, smooth = ReuseController(Config(**cfg)), ReuseController(Config(**cfg, reuse_drift_smoothing=0.1))
    for ctl in (alone, smooth):
        for rollout in range(20):  # a run drifting at rate 4e-4 per squared update
            assert not ctl.step_done(step(rollout, kl=4e-4, it=1), last_in_pass=True)
    assert smooth.rate == pytest.approx(4e-4)
    # one rollout drifts 3x as far (a strong signal): alone, its next pass (~4.8e-3) is cut; smoothed, the rate
    # is 0.9 x 4e-4 + 0.1 x 1.2e-3 = 4.8e-4 and it keeps its replay
    assert alone.step_done(step(20, kl=1.2e-3, it=1), last_in_pass=True)
    assert not smooth.step_done(step(20, kl=1.2e-3, it=1), last_in_pass=True)
    assert smooth.rate == pytest.approx(4.8e-4)
    for rollout in range(21, 40):  # a lasting change of regime moves the average: replays stop within ~15 passes
        cut = smooth.step_done(step(rollout, kl=1.2e-3, it=1), last_in_pass=True)
    assert cut and smooth.rate > 1e-3
    # an on-policy pass carries no drift and leaves the rate alone; the rate is checkpointed
    rate = smooth.rate
    assert not smooth.step_done(step(40, kl=0.0, it=0), last_in_pass=True) and smooth.rate == rate
    again = ReuseController(Config(**cfg, reuse_drift_smoothing=0.1))
    again.load_state_dict(smooth.state_dict())
    assert again.rate == rate


def test_auto_prices_each_rollout_with_the_cost_ratio_measured_after_the_warmup(world_of_one):
    ctl = ReuseController(Config(num_iterations="auto", reuse_measure_rollouts=2, reuse_max_kl=6e-3))
    for r, gen, train_per_pass, passes in [(0, 50.0, 9.0, 1), (1, 3.0, 1.0, 3), (2, 5.0, 1.0, 1)]:
        for p in range(passes):
            ctl.step_done(step(r, gen=gen if p == 0 else 0.0, train=train_per_pass, it=p), last_in_pass=True)
        assert ctl.cost_ratio is None and ctl.target_kl == pytest.approx(3e-3)  # g = 1/2 until measured
    # rollouts 1-2 only: 8 s for 200 decoding steps, 4 s for 4 passes of 1000 tokens -> a / b = 0.04 / 0.001
    ctl.step_done(step(3, gen=99.0, train=99.0), last_in_pass=True)
    assert ctl.cost_ratio == pytest.approx(40.0)
    assert ctl.target_kl == pytest.approx(4.8e-3) and ctl.status()["reuse_generation_share"] == pytest.approx(0.8)
    # a rollout with half the decoding steps costs half the generation: g = 2/3, a replay may drift less far
    ctl.step_done(step(4, decode=50.0, gen=1.0, train=100.0), last_in_pass=True)
    assert ctl.cost_ratio == pytest.approx(40.0) and ctl.target_kl == pytest.approx(4e-3)  # frozen: timings ignored
    again = ReuseController(Config(num_iterations="auto", reuse_measure_rollouts=2))
    again.load_state_dict(ctl.state_dict())
    assert again.cost_ratio == ctl.cost_ratio and again.odds == ctl.odds


@pytest.mark.parametrize("args, message", [
    (["--num_iterations", "sometimes"], "num_iterations: must be an integer mu >= 1 or auto, got 'sometimes'"),
    (["--reuse_target_kl", "1e-3"], "reuse_target_kl: num_iterations: auto sets the KL target"),
    (["--reuse_max_iterations", "0"], "reuse_max_iterations: must be >= 1"),
    (["--reuse_max_kl", "0"], "reuse_max_kl: must be > 0"),
    (["--reuse_drift_smoothing", "0"], "reuse_drift_smoothing: must be in (0, 1]"),
    (["--reuse_generation_share", "1"], "reuse_generation_share: must be in (0, 1) or null"),
    (["--reuse_measure_rollouts", "0"], "reuse_measure_rollouts: must be >= 1"),
])
def test_bad_reuse_fields_are_named(args, message):
    from grpo_recipe.config.load import load_config
    from grpo_recipe.config.schema import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(["--num_iterations", "auto", *args])
    assert message in str(e.value)


@pytest.mark.slow
def test_run_skips_remaining_passes_and_resumes_exactly(tmp_path):
    # The first pass is on-policy (approx KL exactly 0); every later pass has drifted, so a tiny target
    # stops each rollout after its second pass: mu = 4, 2 passes used.
    out, fixed = tmp_path / "a", ["--num_iterations", "4", "--reuse_target_kl", "1e-9"]
    run(*fixed, "--output_dir", str(out), "--save_steps", "2", "--save_total_limit", "0")
    recs = read_jsonl(out / "metrics.jsonl")
    assert [(r["generation"], r["iteration"]) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["approx_kl"] == 0.0 for r in recs if r["iteration"] == 0)
    assert all(r["approx_kl"] > 0.0 for r in recs if r["iteration"] == 1)
    # Resume from the checkpoint taken exactly at a skip decision (step 4): the next step starts rollout 2.
    resumed = tmp_path / "b"
    shutil.copytree(out / "checkpoints" / "step-00000004", resumed / "checkpoints" / "step-00000004")
    shutil.copy(out / "metrics.jsonl", resumed / "metrics.jsonl")
    run(*fixed, "--output_dir", str(resumed), "--save_steps", "2", "--save_total_limit", "0",
        "--resume_from_checkpoint", "auto")
    assert strip(read_jsonl(resumed / "metrics.jsonl")) == strip(recs)
    huge = tmp_path / "c"
    run("--num_iterations", "4", "--reuse_target_kl", "1e9", "--output_dir", str(huge), "--max_steps", "4",
        "--save_steps", "0")
    assert [r["passes_used"] for r in read_jsonl(huge / "metrics.jsonl")] == [1, 2, 3, 4]


def test_auto_run_trains_a_signal_free_rollout_once(tmp_path):
    # A constant reward: every group's rewards are equal, so auto takes no replay (the length reward's runs
    # below take the first replay of every rollout: a pass on-policy is free of drift).
    out = tmp_path / "out"
    run("--num_iterations", "auto", "--max_steps", "3", "--output_dir", str(out), "--save_steps", "0",
        "--reward_funcs", "[tests.reward_fixtures:numpy_ones]")
    recs = read_jsonl(out / "metrics.jsonl")
    assert [(r["generation"], r["passes_used"], r["frac_reward_zero_std"]) for r in recs] == [(0, 1, 1.0), (1, 1, 1.0),
                                                                                          (2, 1, 1.0)]


@pytest.mark.slow
def test_auto_freezes_the_same_g_on_every_rank_and_a_resume_repeats_every_decision(tmp_path):
    # 2 ranks with their own clocks: the cost ratio from rollout 1 (all-reduced), frozen when rollout 2's first pass
    # ends; from then on each rollout's g follows from its size.
    # (with a moving drift rate, which the checkpoint must carry too)
    out, auto = tmp_path / "a", ["--num_iterations", "auto", "--reuse_measure_rollouts", "1", "--max_steps", "10",
                                 "--save_steps", "2", "--save_total_limit", "0", "--reuse_drift_smoothing", "0.5"]
    torchrun(2, [*RUN, *auto, "--output_dir", str(out)])
    recs = read_jsonl(out / "metrics.jsonl")
    assert recs[1]["iteration"] == 1  # a pass on-policy (KL 0) is always worth a replay
    priced = [r for r in recs if r["reuse_generation_share"] is not None]
    assert priced and all(0 < r["reuse_generation_share"] < 1 for r in priced)
    max_kl = Config().reuse_max_kl
    assert all(r["reuse_kl_target"] == pytest.approx(max_kl * r["reuse_generation_share"]) for r in priced)
    saved = sorted((out / "checkpoints").glob("step-*"))
    for ckpt in saved:  # both ranks hold the same decisions, the same frozen cost ratio and where they are
        states = [safe_load(ckpt / f"loop_rank{r}.pt") for r in (0, 1)]
        assert states[0]["reuse"]["cost_ratio"] == states[1]["reuse"]["cost_ratio"]
        assert states[0]["reuse"]["drift_rate"] == states[1]["reuse"]["drift_rate"]
        assert (states[0]["position"], states[0]["rollout"]) == (states[1]["position"], states[1]["rollout"])
    # Resume from the first checkpoint holding the frozen cost ratio: every later decision and number repeats.
    ckpt = next(c for c in saved if safe_load(c / "loop_rank0.pt")["reuse"]["cost_ratio"] is not None)
    assert safe_load(ckpt / "loop_rank0.pt")["reuse"]["drift_rate"] > 0
    resumed = tmp_path / "b"
    shutil.copytree(ckpt, resumed / "checkpoints" / ckpt.name)
    shutil.copy(out / "metrics.jsonl", resumed / "metrics.jsonl")
    torchrun(2, [*RUN, *auto, "--output_dir", str(resumed), "--resume_from_checkpoint", "auto"])
    assert strip(read_jsonl(resumed / "metrics.jsonl")) == strip(recs)


@pytest.mark.slow
def test_pinned_g_makes_auto_runs_reproducible(tmp_path):
    pinned = ["--num_iterations", "auto", "--reuse_generation_share", "0.6", "--reuse_max_kl", "5e-4"]
    run(*pinned, "--output_dir", str(tmp_path / "a"), "--save_steps", "0")
    run(*pinned, "--output_dir", str(tmp_path / "b"), "--save_steps", "0")
    a, b = (read_jsonl(tmp_path / x / "metrics.jsonl") for x in "ab")
    assert strip(a) == strip(b) and all(r["reuse_kl_target"] == pytest.approx(3e-4) for r in a)
