"""The recipe end to end: plain process, torchrun, the deepspeed launcher, the quickstart config, and the options
users of TRL, OpenRLHF and verl expect on the one loop (schedule, evaluation, samples, trackers, metrics)."""
import subprocess
import sys

import pytest
import torch
from conftest import REPO, torchrun

from grpo_recipe.dist.env import rank_env
from grpo_recipe.run.metrics import read_jsonl, reward_quarters

QUICKSTART = "grpo_recipe/configs/quickstart.yaml"
REQUIRED_KEYS = {"step", "generation", "iteration", "loss", "reward_mean", "reward_std", "reward/length",
                 "reward/length_std", "frac_reward_zero_std", "entropy", "learning_rate",
                 "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "completion_length_mean",
                 "truncated_fraction", "old_logp_forwards", "tokens_per_s", "time_generate_s", "time_score_s",
                 "time_old_logp_s", "time_train_s", "step_time_s"}
SHORT = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
         "--num_generations", "4", "--max_completion_length", "8", "--disable_tqdm", "true"]


def test_rollout_statistics_against_direct_computation():
    from grpo_recipe.algo.loss import zero_std_groups
    from grpo_recipe.generation import Completions
    from grpo_recipe.train import rollout_stats

    g = torch.Generator().manual_seed(0)
    length = torch.randn(12, generator=g)
    nan = float("nan")  # accuracy returned None there: it does not apply to those samples
    accuracy = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, nan, 0, nan])
    length[:4] = length[0]  # group 0: length equal too; group 2 differs in length only
    total = length + 0.5 * accuracy.nan_to_num()
    mask = (torch.arange(6) < torch.randint(1, 7, (12, 1), generator=g)).float()
    comp = Completions([[1]] * 12, mask, mask.sum(-1) == 6, ["x"] * 12)
    stats = rollout_stats(total, {"length": length, "accuracy": accuracy}, comp, 3, 7, False, zero_std_groups(total, 4))
    assert stats["rollout_tokens"] == 7 + mask.sum() and stats["decode_steps"] == mask.sum(-1).max()
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 3)  # group 0 of 3: all its rewards equal
    assert stats["reward_mean"] == pytest.approx(total.mean().item())
    assert stats["reward_std"] == pytest.approx(total.std().item())  # sample std, as torch.std
    assert stats["reward/length_std"] == pytest.approx(length.std().item(), rel=1e-6)
    applies = accuracy[~accuracy.isnan()]  # each function over the samples it applies to
    assert stats["reward/accuracy_std"] == pytest.approx(applies.std().item(), rel=1e-6)
    assert stats["reward/accuracy"] == pytest.approx(5 / 10)
    assert stats["completion_length_mean"] == pytest.approx(mask.sum().item() / 12)
    assert stats["truncated_fraction"] == pytest.approx((mask.sum(-1) == 6).float().mean().item())
    objective = torch.randn(12, generator=g)  # GDPO's sums: their mean and sample std over all ranks come back
    stats = rollout_stats(total, {"length": length}, comp, 3, 7, False, zero_std_groups(total, 4), objective)
    assert stats["objective_mean"] == pytest.approx(objective.mean().item(), abs=1e-6)
    assert stats["objective_std"] == pytest.approx(objective.std().item(), rel=1e-5)


@pytest.mark.slow
def test_gdpo_trains_two_reward_functions_on_two_ranks(tmp_path):
    """multi_objective_aggregation: normalize_then_sum with two functions of very different scales."""
    out = tmp_path / "out"
    funcs = "[length, {func: length, name: short, weight: 0.5, kwargs: {target_chars: 8}}]"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "3",
                 "--num_iterations", "1", "--max_completion_length", "12", "--disable_tqdm", "true",
                 "--multi_objective_aggregation", "normalize_then_sum", "--reward_funcs", funcs,
                 "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and all("reward/short" in r for r in records)
    assert any(r["loss"] != 0.0 for r in records) and "objective_mean" not in records[0]


def check_final_model(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    logits = model(**tok("TL;DR:", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_plain_process_with_kl_and_two_optimizer_steps_per_pass(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, *SHORT,
                           "--num_iterations", "2", "--optimizer_steps_per_pass", "2", "--beta", "0.05",
                           "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [(r["generation"], r["iteration"]) for r in records] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    assert REQUIRED_KEYS | {"kl"} <= set(records[0])
    # spg = 2 -> the second step's half of each rollout needs one no-grad forward per micro-batch, once.
    assert [r["old_logp_forwards"] for r in records] == [1, 1, 1, 1]
    assert records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # first step is on-policy
    assert "reward_mean: first quarter" in proc.stdout
    check_final_model(out)


def test_full_determinism_repeats_a_cpu_run_exactly(tmp_path):
    """full_determinism (TRL's field: transformers' enable_full_determinism) makes a GPU run repeat bit for bit; on
    CPU, already deterministic, it must change nothing: the same losses and rewards on 2 ranks (each rank's seed
    stays seed + rank)."""
    runs = {}
    for name, extra in (("plain", []), ("deterministic", ["--full_determinism", "true"])):
        torchrun(2, ["-m", "grpo_recipe.train", "--config", QUICKSTART, *SHORT, "--num_iterations", "2",
                     "--save_steps", "0", "--output_dir", str(tmp_path / name), *extra])
        runs[name] = [(r["loss"], r["reward_mean"], r["entropy"]) for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
    assert len(runs["plain"]) == 4 and runs["deterministic"] == runs["plain"]


def test_deepspeed_launcher_two_ranks(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", "29731", "--module", "grpo_recipe.train",
                           "--config", QUICKSTART, *SHORT, "--num_iterations", "4", "--output_dir", str(out)], cwd=REPO,
                          env=rank_env(PATH=f"{sys.prefix}/bin:" + rank_env()["PATH"]), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 4 and records[-1]["iteration"] == 3  # mu = 4
    assert records[-1]["old_logp_forwards"] == 0  # spg = 1: captured from the first pass, no extra forward


def test_bad_reward_stops_every_rank_with_its_name(tmp_path):
    out = tmp_path / "out"
    proc = torchrun(2, ["-m", "grpo_recipe.train", "--config", QUICKSTART, *SHORT, "--output_dir", str(out),
                        "--reward_funcs", "[tests.reward_fixtures:has_inf]"], check=False, timeout=600)
    assert proc.returncode != 0
    assert "reward 'has_inf' returned inf at sample 1" in proc.stderr
    assert not (out / "final").exists()


def test_zero_std_filter_leaves_out_groups_whose_rewards_are_all_equal(tmp_path):
    """A constant reward: every group has zero std, so with zero_std_filter no sample is trained on."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, *SHORT, "--max_steps", "2",
                           "--num_iterations", "1", "--zero_std_filter", "true", "--output_dir", str(out),
                           "--reward_funcs", "[tests.reward_fixtures:numpy_ones]"], cwd=REPO, env=rank_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [(r["frac_reward_zero_std"], r["train_tokens"]) for r in records] == [(1.0, 0), (1.0, 0)]
    assert all(r["completion_length_mean"] > 0 for r in records)  # there were tokens to train on


def test_answer_reward_without_answer_column_stops_before_the_model_loads(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", QUICKSTART, "--reward_funcs",
                           "[math_accuracy]", "--output_dir", str(out)], cwd=REPO, env=rank_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: reward 'math_accuracy': dataset has no column 'answer' (have ['post', 'prompt'])" in proc.stderr
    assert "Loading weights" not in proc.stderr and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_quickstart_end_to_end_reward_rises(tmp_path):
    """The README's first command, as on a fresh machine: an empty model cache (CI keeps ~/.cache)."""
    out, cache = tmp_path / "qs", tmp_path / "empty-cache"
    proc = subprocess.run(["bash", "launch/quickstart.sh", "--output_dir", str(out), "--disable_tqdm", "true"],
                          cwd=REPO, env=rank_env(VENV_PY=sys.executable, GRPO_RECIPE_CACHE=cache),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 160 and REQUIRED_KEYS <= set(records[0])
    first, last = reward_quarters(records)
    assert last > first + 5.0, f"reward did not rise clearly: first quarter {first:.2f}, last {last:.2f}"
    # num_iterations: auto (the quickstart's): each rollout but the last (cut by max_steps) replayed at least once (its
    # first pass is on-policy), none past the cap of 4 passes; each step logs the KL target its decision used
    passes = [r["passes_used"] for r in records if r["step"] == len(records) or
              records[r["step"]]["generation"] != r["generation"]]
    assert len(passes) == records[-1]["generation"] + 1 and min(passes[:-1]) >= 2 and max(passes) <= 4
    assert all(r["reuse_kl_target"] > 0 for r in records)
    assert records[-1]["old_logp_forwards"] == 0
    check_final_model(out)


@pytest.mark.slow
@pytest.mark.parametrize("loss", [["--loss_type", "grpo", "--importance_sampling_level", "sequence"],
                                  ["--loss_type", "cispo", "--epsilon_high", "5.0"]], ids=["gspo", "cispo"])
def test_quickstart_reward_rises_with_sequence_level_ratios_and_with_cispo(tmp_path, loss):
    """Two ranks, the quickstart task with mu = 2 (replays: the ratios leave 1), 64 steps."""
    out = tmp_path / "out"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", *loss,
                 "--num_iterations", "2", "--max_steps", "64", "--output_dir", str(out), "--disable_tqdm", "true"],
             timeout=1200)
    records = read_jsonl(out / "metrics.jsonl")
    first, last = reward_quarters(records)
    assert last > first + 4.0, f"reward did not rise clearly: first quarter {first:.2f}, last {last:.2f}"
    assert any(abs(r["ratio_mean"] - 1.0) > 1e-4 for r in records)  # the replays were off-policy


@pytest.mark.slow
def test_train_your_own_example_config_end_to_end(tmp_path):
    """The README's "Train your own model on your own data" example as written there: launch/local.sh on the
    shipped GSM8K-shaped parquet file, the built-in math_accuracy reward and a reward function file."""
    out = tmp_path / "gsm"
    proc = subprocess.run(["bash", "launch/local.sh", "--config", "grpo_recipe/configs/gsm8k_local.yaml", "--max_steps", "4",
                           "--output_dir", str(out), "--disable_tqdm"], cwd=REPO,
                          env=rank_env(VENV_PY=sys.executable, NPROC=2), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"reward/math_accuracy", "reward/format_reward"} <= set(records[0])
    assert all(0.0 <= r["reward/math_accuracy"] <= 1.0 for r in records)
    check_final_model(out)


# Two short 2-rank runs alike but for evaluation, samples and trackers (on in the first, off in the second).
FEATURES = ["--config", QUICKSTART, "--max_steps", "6", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--num_generations", "4", "--max_completion_length", "8",
            "--num_iterations", "2", "--lr_scheduler_type", "cosine", "--warmup_steps", "2", "--min_lr_ratio", "0.1",
            "--eval_holdout_size", "5", "--zero_std_filter", "true", "--save_steps", "2", "--save_total_limit", "0"]
EVAL_ON = ["--eval_steps", "2", "--eval_on_start", "true", "--eval_num_generations", "2",
           "--per_device_eval_batch_size", "2", "--log_completions_steps", "3", "--num_prompts_to_log", "1",
           "--report_to", "[tensorboard, wandb]", "--run_name", "e2e", "--logging_steps", "5",
           "--disable_tqdm", "false"]
TRAINING_ONLY = {"tokens_per_s", "step_time_s", "step_cpu_s"}  # timings differ run to run


def training_part(record):
    return {k: v for k, v in record.items() if not k.startswith(("eval/", "time_")) and k not in TRAINING_ONLY}


def greedy_eval_reward_of_the_initial_model(tiny_model_dir):
    """Independently: each held-out prompt decoded greedily, alone, by the plain model; the length reward's mean."""
    from transformers import AutoModelForCausalLM

    from grpo_recipe.config.load import load_config
    from grpo_recipe.data.prompts import PromptStream, load_datasets
    from grpo_recipe.model.load import load_tokenizer

    cfg = load_config(FEATURES)
    tok = load_tokenizer(str(tiny_model_dir))
    held = PromptStream(load_datasets(cfg)[1], tok, cfg, 0, 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rewards = []
    for ids in held.rows(list(range(5))).prompt_ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        rewards.append(-abs(40 - len(tok.decode(out[0, len(ids):], skip_special_tokens=True))))
    return sum(rewards) / len(rewards)


@pytest.mark.slow
def test_eval_samples_trackers_and_schedule_leave_training_unchanged(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    from test_trackers import SECRET, assert_no_secret, tensorboard_events, wandb_config, wandb_history

    from grpo_recipe.algo.schedule import lr_factor

    on, off = tmp_path / "on", tmp_path / "off"
    proc = torchrun(2, ["-m", "grpo_recipe.train", *FEATURES, *EVAL_ON, "--output_dir", str(on)], WANDB_MODE="offline",
                    WANDB_API_KEY=SECRET, WANDB_SILENT="true")
    torchrun(2, ["-m", "grpo_recipe.train", *FEATURES, "--disable_tqdm", "true", "--output_dir", str(off)])

    # Evaluation costs no training state: same weights, same training metrics, same RNG streams at every save.
    a, b = load_file(str(on / "final" / "model.safetensors")), load_file(str(off / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    with_eval, without = read_jsonl(on / "metrics.jsonl"), read_jsonl(off / "metrics.jsonl")
    by_step = {r["step"]: r for r in without}
    assert [r["step"] for r in with_eval] == [0, 2, 4, 5, 6]  # eval_on_start, eval steps, logging_steps 5, the last
    assert all(training_part(r) == training_part(by_step[r["step"]]) for r in with_eval[1:])
    for step in (2, 4, 6):
        for rank in (0, 1):
            rng_on, rng_off = (torch.load(d / "checkpoints" / f"step-{step:08d}" / f"loop_rank{rank}.pt",
                                          weights_only=True)["rng"] for d in (on, off))
            assert rng_on["python"] == rng_off["python"] and torch.equal(rng_on["torch"], rng_off["torch"])
            assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                       for x, y in zip(rng_on["numpy"], rng_off["numpy"]))

    # The schedule: once per optimizer step (2 micro-batches each), warmup then cosine to 0.1 x lr.
    lrs = [r["learning_rate"] for r in without]
    assert lrs == pytest.approx([0.002 * lr_factor(k, "cosine", 6, 2, 0.1) for k in range(6)], abs=1e-12)
    assert lrs[:3] == pytest.approx([0.0, 0.001, 0.002])

    # eval/ metrics at steps 0, 2, 4, 6 only; at step 0 equal to the plain model's greedy decoding of the held-out set
    keys = {"eval/prompts", "eval/greedy/reward", "eval/greedy/reward/length", "eval/greedy/completion_length",
            "eval/sampled/reward", "eval/sampled/reward/length", "eval/sampled/completion_length", "eval/time_s"}
    assert [r["step"] for r in with_eval if keys <= set(r)] == [0, 2, 4, 6] and with_eval[0]["eval/prompts"] == 5
    assert not any(k.startswith("eval/") for k in with_eval[3])
    for r in with_eval[:3]:  # sampled completions: the length reward's range, not the greedy ones
        assert -40.0 <= r["eval/sampled/reward"] <= 0.0 and r["eval/sampled/reward"] == r["eval/sampled/reward/length"]
    assert [r["eval/sampled/completion_length"] for r in with_eval[:3]] != \
        [r["eval/greedy/completion_length"] for r in with_eval[:3]]
    assert with_eval[0]["eval/greedy/reward"] == pytest.approx(greedy_eval_reward_of_the_initial_model(tiny_model_dir))

    # completions.jsonl: rank 0's first prompt with its 4 completions at steps 3 and 6; rewards and advantages direct
    rows = read_jsonl(on / "completions.jsonl")
    assert [r["step"] for r in rows] == [3] * 4 + [6] * 4
    assert set(rows[0]) == {"step", "generation", "prompt", "completion", "reward", "reward/length", "advantage"}
    for group in (rows[:4], rows[4:]):
        rewards = torch.tensor([-abs(40.0 - len(r["completion"])) for r in group])
        assert [r["reward"] for r in group] == rewards.tolist() == [r["reward/length"] for r in group]
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # TRL's std + 1e-4
        assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-6)
        assert len({r["prompt"] for r in group}) == 1
    assert {r["generation"] for r in rows} == {1, 2}  # steps 3 and 6 train on rollouts 1 and 2

    # TensorBoard and wandb (offline) got the same numbers; the secret from the environment reached no file
    tb = tensorboard_events(on / "tensorboard")
    assert [e.step for e in tb.Scalars("eval/greedy/reward")] == [0, 2, 4, 6]
    assert [e.value for e in tb.Scalars("learning_rate")] == pytest.approx([r["learning_rate"] for r in with_eval[1:]])
    assert [e.step for e in tb.Tensors("completions/text_summary")] == [3, 6]
    (run_dir,) = (on / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    assert sorted(history) == [0, 2, 3, 4, 5, 6]  # step 3: the completions table only
    assert [history[s]["learning_rate"] for s in (2, 4, 5, 6)] == pytest.approx(lrs[1:2] + lrs[3:])
    assert history[0]["eval/greedy/reward"] == with_eval[0]["eval/greedy/reward"]
    assert history[3]["completions/nrows"] == 4 and wandb_config(run_dir)["lr_scheduler_type"] == "cosine"
    assert_no_secret(on)

    # the bar moved every optimizer step although only steps 5 and 6 were logging steps
    assert all(f"| {k}/6 [" in proc.stderr for k in range(1, 7))
