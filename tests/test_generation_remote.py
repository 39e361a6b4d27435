"""Generation on its own ranks (grpo_recipe/generation/remote.py, grpo_recipe/dist/link.py): the colocated layout's
update at max_staleness 0, the lag accounted for at 1 on the quickstart task (whose reward rises), exact resume
after SIGKILL with a rollout in flight, a stopped generation rank named; the config's errors."""
import os
import random
import signal
import subprocess
import time

import pytest
import torch
from conftest import REPO, needs_vllm, torchrun
from procs import rank_pids, wait_for_step
from test_checkpoint import signal_tree, weights

from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import ConfigError
from grpo_recipe.dist.env import rank_env
from grpo_recipe.dist.env import torchrun as torchrun_cmd
from grpo_recipe.dist.link import Layout
from grpo_recipe.run.metrics import read_jsonl, reward_quarters

# the quickstart's task at a fixed mu = 2 (auto prices passes from each run's clock: two runs need not agree)
SHORT = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--num_iterations", "2",
         "--max_steps", "8", "--disable_tqdm", "true"]
SEPARATE = ["--generation_ranks", "1"]


def test_the_layout_deals_trainers_to_the_last_ranks():
    lay = Layout(rank=0, world=5, generators=2)
    assert lay.trainers == 3 and [lay.generator_of(t) for t in range(3)] == [3, 4, 3]
    assert lay.served_by(3) == [0, 2] and lay.served_by(4) == [1]
    assert not lay.is_generator and Layout(rank=3, world=5, generators=2).is_generator


@pytest.mark.parametrize("args, world, message", [
    (["--generation_ranks", "1"], 1, "generation_ranks: 1 leaves no training rank in a launch of 1 rank(s); "
                                     "launch at least 2 ranks"),
    (["--generation_ranks", "2"], 2, "generation_ranks: 2 leaves no training rank in a launch of 2 rank(s)"),
    (["--generation_ranks", "1", "--generation_backend", "vllm", "--vllm_tensor_parallel_size", "3"], 3,
     "vllm_tensor_parallel_size: each generation rank runs its own engine"),
    (["--generation_ranks", "1", "--generation_backend", "vllm", "--use_peft", "true", "--vllm_lora_sync", "adapter"],
     3, "vllm_lora_sync: adapter is for a colocated engine"),
    (["--generation_ranks", "1", "--generation_backend", "vllm", "--vllm_enable_sleep_mode", "true"], 3,
     "vllm_enable_sleep_mode: frees a colocated engine's memory"),
    (["--max_staleness", "1"], 2, "max_staleness: 1 needs generation_ranks >= 1"),
    (["--generation_ranks", "1", "--max_staleness", "2"], 3, "max_staleness: must be 0 or 1, got 2"),
    (["--generation_ranks", "-1"], 2, "generation_ranks: must be >= 0, got -1"),
])
def test_config_errors_name_the_field(args, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(args, world_size=world)


def comparable(records):
    """A step's record without its clocks (and without the generation ranks' own fields)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith(("is_", "staleness"))
             and k != "weight_syncs"} for r in records]


@pytest.mark.slow
def test_staleness_0_samples_and_updates_as_the_colocated_layout(tmp_path):
    """2 training ranks + 1 generation rank at max_staleness 0: the same completions (same weights, prompts and
    seeds), so the same rewards and updates as 2 colocated ranks; the sampler's log-probs equal the trainer's."""
    torchrun(2, [*SHORT, "--output_dir", str(tmp_path / "colocated")])
    torchrun(3, [*SHORT, *SEPARATE, "--output_dir", str(tmp_path / "separate")])
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("colocated", "separate"))
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]  # the very same samples
    assert [r["completion_length_mean"] for r in a] == [r["completion_length_mean"] for r in b]
    for ra, rb in zip(comparable(a), comparable(b)):
        assert ra.keys() == rb.keys()
        for k in ra:
            # the loss carries the sampler correction's weights, 1 up to the generation rank's decoding numerics
            # (is_ratio_mean below): the update differs from the colocated one by that noise, and only by it
            tol = {"rel": 1e-3, "abs": 1e-6}
            if ra[k] is None:  # a figure of num_iterations: auto, absent at a fixed mu
                assert rb[k] is None, f"step {ra['step']}: {k}"
            else:
                assert ra[k] == pytest.approx(rb[k], **tol), f"step {ra['step']}: {k}"
    assert all(r["staleness_steps"] == 0 for r in b)
    assert all(abs(r["is_ratio_mean"] - 1.0) < 1e-4 for r in b), [r["is_ratio_mean"] for r in b]
    wa, wb = weights(tmp_path / "colocated"), weights(tmp_path / "separate")
    for k in wa:
        # Adam turns that noise into at most a few percent of one step (lr 2e-3) on a weight whose gradient is ~0
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_staleness_1_quickstart_reward_rises_with_the_lag_accounted_for(tmp_path):
    """The quickstart task on 2 training ranks + 1 generation rank, rollout k + 1 sampled while rollout k trains:
    its samples come from weights one rollout (2 optimizer steps) older, the loss weighs them by the sampler's
    log-probs (which then differ from the trainer's), and the reward still rises."""
    out = tmp_path / "out"
    torchrun(3, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", *SEPARATE,
                 "--max_staleness", "1", "--num_iterations", "2", "--max_steps", "64", "--output_dir", str(out),
                 "--disable_tqdm", "true"], timeout=1200)
    records = read_jsonl(out / "metrics.jsonl")
    lag = {r["generation"]: r["staleness_steps"] for r in records}
    assert lag[0] == 0 and all(lag[g] == 2 for g in lag if g > 0), lag
    first_rollout = [r["is_ratio_mean"] for r in records if r["generation"] == 0]
    assert all(abs(x - 1.0) < 1e-4 for x in first_rollout)  # sampled from the weights it trains from
    assert any(abs(r["is_ratio_mean"] - 1.0) > 1e-3 for r in records if r["generation"] > 0)
    first, last = reward_quarters(records)
    assert last > first + 4.0, f"reward did not rise clearly: first quarter {first:.2f}, last {last:.2f}"
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_lora_on_a_tied_head_samples_as_the_colocated_layout(tmp_path, backend):
    """The LoRA quickstart (an adapter on the output head, which the tiny model ties to the embeddings): the
    trainers send the merged head apart from the embeddings, and the generation rank unties them (transformers)
    or builds its engine untied (vLLM), so it samples from the trainers' policy. (Before, the merged head
    overwrote the shared embeddings there: sampler / trainer ratios up to 2.6 from the second rollout on.)"""
    run = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_lora.yaml", "--num_iterations", "2",
           "--max_steps", "6", "--disable_tqdm", "true", "--generation_backend", backend]
    torchrun(2, [*run, "--output_dir", str(tmp_path / "colocated")])
    torchrun(3, [*run, *SEPARATE, "--output_dir", str(tmp_path / "separate")])
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("colocated", "separate"))
    assert [r["generation"] for r in b] == [0, 0, 1, 1, 2, 2]
    if backend == "vllm":  # merged weights in a vLLM engine on both sides: the very same samples and correction
        assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
        assert [r["is_ratio_mean"] for r in b] == pytest.approx([r["is_ratio_mean"] for r in a], abs=1e-5)
        assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-3, abs=1e-6)
    else:
        # the generation rank's policy is the trainers': every sampled token has the same probability under both
        assert all(abs(r["is_ratio_mean"] - 1.0) < 1e-4 and r["is_ratio_max"] < 1.0 + 1e-4 for r in b), \
            [(r["is_ratio_mean"], r["is_ratio_max"]) for r in b]
        # rollout 0 (B = 0: the same weights) gives the same samples; later, merged W + BA and the colocated
        # peft layers (W x + B A x) differ by rounding, which can flip a near-tie token
        assert [r["reward_mean"] for r in a[:2]] == [r["reward_mean"] for r in b[:2]]


@pytest.mark.slow
def test_staleness_1_with_auto_lags_by_the_passes_of_the_rollout_before(tmp_path):
    """num_iterations: auto picks each rollout's passes as it trains; at max_staleness 1 rollout g was sampled
    from the weights rollout g - 1 started with, so its lag is exactly the optimizer steps rollout g - 1 took."""
    out = tmp_path / "out"
    torchrun(3, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", *SEPARATE,
                 "--max_staleness", "1", "--num_iterations", "auto", "--max_steps", "12", "--output_dir", str(out),
                 "--disable_tqdm", "true"])
    records = read_jsonl(out / "metrics.jsonl")
    steps = {}  # optimizer steps per rollout
    for r in records:
        steps[r["generation"]] = steps.get(r["generation"], 0) + 1
    lag = {r["generation"]: r["staleness_steps"] for r in records}
    assert len(lag) >= 3, lag  # a few rollouts, so that the lag has been set by auto's own choices
    assert lag[0] == 0 and all(lag[g] == steps[g - 1] for g in lag if g > 0), (lag, steps)
    assert all(r["staleness_steps"] == lag[r["generation"]] for r in records)  # fixed within a rollout


@pytest.mark.slow
def test_sigkill_with_a_rollout_in_flight_then_resume_is_bit_identical(tmp_path):
    """At max_staleness 1 a rollout is always in flight while another trains: a checkpoint keeps it, so the
    resumed run trains on the very samples the uninterrupted one did."""
    run = [*SHORT, *SEPARATE, "--max_staleness", "1", "--max_steps", "12", "--save_steps", "3",
           "--save_total_limit", "0"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    torchrun(3, [*run, "--output_dir", str(ref)])
    proc = subprocess.Popen(torchrun_cmd(3, [*run, "--output_dir", str(out)]), cwd=REPO, env=rank_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(proc, out, random.Random().choice([4, 5, 6, 7]))
    signal_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    proc = torchrun(3, [*run, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    wa, wb = weights(ref), weights(out)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs after resume"
    ra, rb = read_jsonl(ref / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 13))
    keep = lambda r: {k: v for k, v in r.items() if not k.endswith("_s")}  # noqa: E731 -- all but the clocks
    assert [keep(r) for r in ra] == [keep(r) for r in rb]


@pytest.mark.slow
def test_a_stopped_generation_rank_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(torchrun_cmd(3, [*SHORT, *SEPARATE, "--max_steps", "40", "--collective_timeout_s",
                                             "20", "--output_dir", str(out)]),
                            cwd=REPO, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for_step(proc, out, 2)
    generator = rank_pids(proc.pid)[2]
    stopped = time.monotonic()
    try:
        os.kill(generator, signal.SIGSTOP)
        _, err = proc.communicate(timeout=180)
    finally:
        signal_tree(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "rank 2 stopped answering" in err, err[-3000:]
    assert time.monotonic() - stopped < 150
