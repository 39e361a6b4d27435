"""Checkpoints: exact resume after SIGKILL or SIGTERM mid mu-cycle, atomic saves, config checks, safe loading."""
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, torchrun
from procs import descendants, wait_for_step

from grpo_recipe.config.schema import Config
from grpo_recipe.dist.env import PREEMPTED_EXIT_CODE, rank_env
from grpo_recipe.dist.env import torchrun as torchrun_cmd
from grpo_recipe.run.checkpoint import Checkpointer, CheckpointError, as_today, rng_state, safe_load, set_rng_state
from grpo_recipe.run.metrics import read_jsonl

# The quickstart's shape (2 ranks, ZeRO-3) at a fixed mu = 4 made short: 12 steps = 3 rollouts of 4 passes (a fixed
# mu: num_iterations: auto prices g from each run's clock, so two runs need not take the same passes; its resume is
# tested in test_reuse.py). The learning rate warms up over 8 steps, then decays (cosine): every resume below
# (from step 3 or 6) crosses the warmup's end.
RUN = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--num_iterations", "4",
       "--max_steps", "12", "--save_steps", "3",
       "--save_total_limit", "0", "--disable_tqdm", "true", "--lr_scheduler_type", "cosine", "--warmup_steps", "8"]
TIMING = {"tokens_per_s", "step_time_s", "step_cpu_s"}  # and every time_*_s key


def weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.split("/")[-1].startswith("time_")}
            for r in records]  # eval/time_s too


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs after resume"
    ra, rb = comparable(read_jsonl(a / "metrics.jsonl")), comparable(read_jsonl(b / "metrics.jsonl"))
    assert [r["step"] for r in rb] == list(range(1, 13))
    assert ra == rb  # learning_rate included: the schedule resumed where it was
    lrs = [r["learning_rate"] for r in rb]
    assert lrs[:9] == pytest.approx([0.002 * k / 8 for k in range(9)]) and lrs[8] > lrs[9] > lrs[10] > lrs[11] > 0


def start(out, *extra, run=RUN):
    return subprocess.Popen(torchrun_cmd(2, [*run, "--output_dir", str(out), *extra]), cwd=REPO, env=rank_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def signal_tree(pid, sig):
    """Signal a launcher and all its descendants at once (torchrun starts each rank in its own session)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    torchrun(2, [*RUN, "--output_dir", str(out)])
    return out


@pytest.mark.slow
def test_sigkill_mid_cycle_then_auto_resume_is_bit_identical(tmp_path, uninterrupted):
    out = tmp_path / "out"
    kill_after = random.Random().choice([4, 5, 6, 7, 8])
    print(f"SIGKILL after step {kill_after}")
    proc = start(out)
    wait_for_step(proc, out, kill_after)
    signal_tree(proc.pid, signal.SIGKILL)  # the launcher and every rank, with no chance to clean up
    proc.wait()
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved and not (out / "final").exists()
    assert int(saved[-1].split("-")[1]) % 4 != 0  # resuming in the middle of a rollout's mu passes
    proc = torchrun(2, [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert f"resumed from {out / 'checkpoints' / saved[-1]}" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(uninterrupted, out)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_identically(tmp_path, uninterrupted):
    out = tmp_path / "out"
    proc = start(out, "--save_steps", "0")  # no scheduled saves: the only checkpoint is the signal's
    wait_for_step(proc, out, 6)
    signal_tree(proc.pid, signal.SIGTERM)  # as Slurm signals every process of a job step
    _, err = proc.communicate(timeout=120)
    assert f"checkpoint saved, exit {PREEMPTED_EXIT_CODE}" in err, err[-4000:]
    saved = list((out / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and not (out / "final").exists()
    stopped_at = int(saved[0].name.split("-")[1])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")][-1] == stopped_at
    torchrun(2, [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "auto", "--save_steps", "0"])
    assert_same_run(uninterrupted, out)


def test_sigusr1_in_a_plain_process_exits_with_the_documented_code(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, *RUN, "--output_dir", str(out), "--save_steps", "0"], cwd=REPO,
                            env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, out, 2)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert len(list((out / "checkpoints").glob("step-*"))) == 1


@pytest.mark.slow
def test_truncated_checkpoint_is_skipped_and_previous_used(tmp_path, uninterrupted):
    out = tmp_path / "out"
    # the reference run's folder as it was at step 9, checkpoints at 3, 6, 9 with its metrics and run record (a
    # 9-step run would have another cosine schedule)
    shutil.copytree(uninterrupted, out, ignore=lambda folder, names: [
        n for n in names if n in ("step-00000012", "final", "run.lock")])
    newest = out / "checkpoints" / "step-00000009"
    victim = newest / "loop_rank1.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a save cut off mid-write
    (out / "checkpoints" / ".tmp-step-00000012").mkdir()  # an unfinished save is never a candidate
    proc = torchrun(2, [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert f"warning: skipping checkpoint {newest}: file loop_rank1.pt has" in proc.stderr
    assert "resumed from" in proc.stderr and "step-00000006 at step 6" in proc.stderr
    assert_same_run(uninterrupted, out)


def test_resume_with_changed_num_generations_is_refused(tmp_path, uninterrupted):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    os.symlink(uninterrupted / "checkpoints" / "step-00000012", out / "checkpoints" / "step-00000012")
    proc = torchrun(2, [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "auto", "--num_generations", "4",
                        "--max_steps", "20"], check=False)
    assert proc.returncode != 0
    assert "cannot resume from" in proc.stderr and "num_generations: 8 -> 4" in proc.stderr
    # max_steps sets the cosine schedule's length here, so it may not change either
    assert "max_steps: 12 -> 20 (it sets the length of the learning-rate schedule" in proc.stderr


def test_resuming_beyond_max_steps_is_refused_not_saved_as_final(tmp_path):
    """A checkpoint at step 8 with max_steps 6: its final model would be a later one than asked for."""
    folder = tmp_path / "step-00000008"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"world_size": 1, "step": 8, "config": Config(max_steps=10).to_dict()}))
    with pytest.raises(CheckpointError, match=r"it is at step 8, beyond max_steps 6; raise max_steps, or resume from "
                                              r"a checkpoint at or before step 6"):
        Checkpointer(Config(max_steps=6), 0, 1).check_config(folder)
    Checkpointer(Config(max_steps=8), 0, 1).check_config(folder)  # at max_steps: writes the final model only


def test_max_steps_may_change_unless_the_schedule_depends_on_it(tmp_path):
    folder = tmp_path / "step-00000004"
    folder.mkdir()

    def check(saved: Config, now: Config):
        (folder / "meta.json").write_text(json.dumps({"world_size": 1, "step": 4, "config": saved.to_dict()}))
        Checkpointer(now, 0, 1).check_config(folder)

    warm = {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 3}
    check(Config(max_steps=10, **warm), Config(max_steps=50, **warm, eval_steps=5, eval_dataset_name="e.jsonl",
                                               report_to=["tensorboard"], log_completions_steps=2))
    for schedule in ({"lr_scheduler_type": "linear"},
                     {"lr_scheduler_type": "constant_with_warmup", "warmup_ratio": 0.1}):
        with pytest.raises(CheckpointError, match="max_steps: 10 -> 50 .it sets the length"):
            check(Config(max_steps=10, **schedule), Config(max_steps=50, **schedule))
    with pytest.raises(CheckpointError, match="eval_holdout_size: 0 -> 4"):  # it changes the training prompts
        check(Config(), Config(eval_holdout_size=4))


def test_explicit_path_must_be_complete(tmp_path):
    cfg = Config(output_dir=str(tmp_path), resume_from_checkpoint=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="not a folder"):
        Checkpointer(cfg, 0, 1).find()
    (tmp_path / "step-1").mkdir()
    cfg.resume_from_checkpoint = str(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match="no meta.json"):
        Checkpointer(cfg, 0, 1).find()
    cfg.resume_from_checkpoint = "auto"
    assert Checkpointer(cfg, 0, 1).find() is None  # nothing saved yet: a fresh start


def manifest_checkpoint(folder, step):
    """A checkpoint folder with a manifest as Checkpointer.save writes it (contents do not matter to find())."""
    import json

    from grpo_recipe.run.checkpoint import _file_sizes, crc32_file

    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "shard.pt").write_bytes(bytes(range(256)) * 32)
    sizes = _file_sizes(folder)
    (folder / "meta.json").write_text(json.dumps({"step": step, "world_size": 1, "config": {}, "files": sizes,
                                                 "checksums": {r: crc32_file(folder / r) for r in sizes}}))


def test_a_checkpoint_corrupted_in_place_is_skipped_for_the_previous_one(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (3, 6):
        manifest_checkpoint(root / f"step-{step:08d}", step)
    shard = root / "step-00000006" / "ds" / "shard.pt"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x10  # same size: only the checksum tells
    shard.write_bytes(bytes(data))
    cfg = Config(output_dir=str(tmp_path), resume_from_checkpoint="auto")
    assert Checkpointer(cfg, 0, 1).find() == root / "step-00000003"
    assert f"warning: skipping checkpoint {root / 'step-00000006'}: file ds/shard.pt does not match its checksum" \
        in capsys.readouterr().err
    cfg.resume_from_checkpoint = str(root / "step-00000006")
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        Checkpointer(cfg, 0, 1).find()


@pytest.mark.parametrize("meta,problem", [
    ([1, 2], "not a JSON object"),
    ({"world_size": 1, "config": {}, "files": {}}, "no step"),
    ({"step": "6", "world_size": 1, "config": {}, "files": {}}, 'step is "6"'),
    ({"step": 6, "world_size": 0, "config": {}, "files": {}}, "world_size is 0"),
    ({"step": 6, "world_size": 1, "config": [], "files": {}}, "config is []"),
    ({"step": 6, "world_size": 1, "config": {}, "files": {"ds/shard.pt": -1}}, "files is"),
    ({"step": 6, "world_size": 1, "config": {}, "files": {}, "checksums": {"a": 1}}, "checksums is"),
    ({"step": 6, "world_size": 1, "config": {}, "files": {}, "run_id": 7}, "run_id is 7"),
], ids=["list", "no_step", "step_text", "world_0", "config_list", "negative_size", "checksum_int", "run_id_int"])
def test_a_meta_json_of_another_shape_is_skipped_in_one_line_never_a_traceback(tmp_path, capsys, meta, problem):
    """A newest checkpoint whose meta.json parses but is not what the recipe writes (edited, another tool's):
    `auto` (with and without a lineage) resumes from the previous one and says why; named explicitly, it is
    refused in one line."""
    import json

    root = tmp_path / "checkpoints"
    for step in (3, 6):
        manifest_checkpoint(root / f"step-{step:08d}", step)
    good = root / "step-00000003" / "meta.json"
    good.write_text(json.dumps(json.loads(good.read_text()) | {"run_id": "r"}))  # the lineage's run wrote it
    (root / "step-00000006" / "meta.json").write_text(json.dumps(meta))
    cfg = Config(output_dir=str(tmp_path), resume_from_checkpoint="auto")
    for lineage in (None, [{"run_id": "r", "from_step": 0}]):
        ck = Checkpointer(cfg, 0, 1)
        assert ck.find(lineage) == root / "step-00000003"
        err = capsys.readouterr().err
        assert f"warning: skipping checkpoint {root / 'step-00000006'}: meta.json is not one this recipe writes: " \
               f"{problem}" in err, err
    cfg.resume_from_checkpoint = str(root / "step-00000006")
    with pytest.raises(CheckpointError, match="meta.json is not one this recipe writes"):
        Checkpointer(cfg, 0, 1).find()


def test_a_save_that_cannot_fit_writes_nothing_and_keeps_the_others(tmp_path):
    manifest_checkpoint(tmp_path / "checkpoints" / "step-00000003", 3)
    ck = Checkpointer(Config(output_dir=str(tmp_path), save_total_limit=2), 0, 1)
    ck.last_bytes = 1 << 60  # the last checkpoint's size: no disk has that free
    with pytest.raises(CheckpointError) as e:
        ck.save(engine=None, step=6, loop_state={})  # refused before the engine is asked for anything
    assert str(e.value).startswith(f"checkpoint {tmp_path / 'checkpoints' / 'step-00000006'}: not enough disk space")
    assert "save_total_limit 2 keeps 2 and writes 1 more" in str(e.value)
    assert str(e.value).endswith("nothing written, kept step-00000003")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003"]


class Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_loading_never_unpickles_code(tmp_path, monkeypatch, uninterrupted):
    monkeypatch.chdir(tmp_path)
    torch.save({"step": 1, "x": Evil()}, tmp_path / "loop_rank0.pt")
    with pytest.raises(pickle.UnpicklingError):
        safe_load(tmp_path / "loop_rank0.pt")
    assert not (tmp_path / "PWNED").exists()
    # while every file of a real checkpoint (DeepSpeed's shards included) loads under the same rule
    for f in (uninterrupted / "checkpoints" / "step-00000012").rglob("*.pt"):
        assert isinstance(safe_load(f), dict)


def test_rng_states_round_trip():
    import numpy as np

    state = rng_state()
    a = (random.random(), torch.rand(3), np.random.rand(2))
    set_rng_state(state)
    b = (random.random(), torch.rand(3), np.random.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and (a[2] == b[2]).all()


def test_resume_config_check_ignores_fields_added_later_at_their_default(tmp_path):
    import json

    from grpo_recipe.config.schema import Config

    folder = tmp_path / "step-1"
    folder.mkdir()
    old = Config().to_dict()
    del old["stop"], old["system_prompt"]  # a checkpoint written before these fields existed
    (folder / "meta.json").write_text(json.dumps({"config": old, "world_size": 1}))
    Checkpointer(Config(), 0, 1).check_config(folder)
    with pytest.raises(CheckpointError, match=r"the config differs in stop: \[\] -> \['x'\]"):
        Checkpointer(Config(stop=["x"]), 0, 1).check_config(folder)


def test_a_checkpoint_from_the_cap_of_4_names_the_flag_that_resumes_it(tmp_path):
    """num_iterations: auto's default cap went from 4 to 8 passes (2026-12-04): a run saved under the old default
    is refused with the field named (the README's advice: resume with --reuse_max_iterations 4), and resumes so."""
    import json

    from grpo_recipe.config.schema import Config

    folder = tmp_path / "step-1"
    folder.mkdir()
    saved = Config(num_iterations="auto", reuse_max_iterations=4).to_dict()
    (folder / "meta.json").write_text(json.dumps({"config": saved, "world_size": 1}))
    with pytest.raises(CheckpointError, match=r"the config differs in reuse_max_iterations: 4 -> 8"):
        Checkpointer(Config(num_iterations="auto"), 0, 1).check_config(folder)
    Checkpointer(Config(num_iterations="auto", reuse_max_iterations=4), 0, 1).check_config(folder)


def test_a_checkpoint_of_the_former_default_auto_names_the_flag_that_resumes_it(tmp_path):
    """The default went from num_iterations: auto back to 1 (TRL's) after the real-model comparison: a run that
    relied on the former default is refused naming the field (the README's advice: --num_iterations auto), and
    resumes so."""
    import json

    from grpo_recipe.config.schema import Config

    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"config": Config(num_iterations="auto").to_dict(), "world_size": 1}))
    with pytest.raises(CheckpointError, match=r"the config differs in num_iterations: 'auto' -> 1"):
        Checkpointer(Config(), 0, 1).check_config(folder)
    Checkpointer(Config(num_iterations="auto"), 0, 1).check_config(folder)


def test_a_checkpoint_from_before_trls_loss_fields_resumes_only_into_the_behaviour_it_trained_with():
    """Fields added since a checkpoint was written take the value that reproduces its training: vllm_tis_cap was
    TRL's token_truncate; a vLLM run without it had no drift correction; a beta > 0 run had no KL bias correction.
    A resume under today's defaults is then refused naming the field, not silently changed."""
    base = {k: v for k, v in Config().to_dict().items()
            if k not in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                         "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                         "use_bias_correction_kl")}
    capped = as_today({**base, "generation_backend": "vllm", "vllm_tis_cap": 2.0})
    assert capped["vllm_importance_sampling_mode"] == "token_truncate"
    assert (capped["vllm_importance_sampling_clip_max"], capped["vllm_importance_sampling_clip_min"]) == (2.0, None)
    assert "vllm_tis_cap" not in capped
    assert as_today({**base, "generation_backend": "vllm"})["vllm_importance_sampling_correction"] is False
    assert as_today({**base, "beta": 0.1})["use_bias_correction_kl"] is False
    assert as_today(base) == Config().to_dict()  # an hf run without beta: nothing it trained with changed


@pytest.mark.slow
def test_adaptive_entropy_and_the_top_entropy_mask_resume_exactly(tmp_path):
    """The adaptive entropy coefficient is part of where the loop is: a run resumed from step 4 of 6 (mid
    rollout, mu = 4) ends with the uninterrupted run's weights and records, entropy_coef included."""
    run = [*RUN[:RUN.index("--num_iterations")], "--num_iterations", "4", "--max_steps", "6", "--save_steps", "2",
           "--save_total_limit", "0", "--disable_tqdm", "true", "--use_adaptive_entropy", "true",
           "--entropy_coef", "0.01", "--entropy_coef_delta", "0.01", "--entropy_target", "100",
           "--top_entropy_quantile", "0.5"]
    ref = tmp_path / "ref"
    torchrun(2, [*run, "--output_dir", str(ref)])
    records = read_jsonl(ref / "metrics.jsonl")
    assert [round(r["entropy_coef"], 6) for r in records] == [0.02, 0.03, 0.04, 0.05, 0.06, 0.07]
    assert all(0.4 < r["high_entropy_fraction"] < 0.6 for r in records)
    out = tmp_path / "out"
    shutil.copytree(ref, out, ignore=lambda folder, names: [
        n for n in names if n in ("step-00000006", "final", "run.lock")])
    proc = torchrun(2, [*run, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert "step-00000004 at step 4" in proc.stderr, proc.stderr[-3000:]
    wa, wb = weights(ref), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(records)


@pytest.mark.slow
def test_a_synced_reference_is_part_of_the_checkpoint_and_resumes_exactly(tmp_path):
    """sync_ref_model (TR-DPO), mixed at steps 2, 4 and 6: a resume from the checkpoint at step 3 (holding the mix
    of step 2) ends with the uninterrupted run's weights and records (the KL to the reference included), which a
    reference restarted from the model folder would not give."""
    run = [*RUN[:RUN.index("--num_iterations")], "--num_iterations", "2", "--max_steps", "6", "--save_steps", "3",
           "--save_total_limit", "0", "--disable_tqdm", "true", "--beta", "0.1", "--learning_rate", "0.01",
           "--sync_ref_model", "true", "--ref_model_sync_steps", "2", "--ref_model_mixup_alpha", "0.5",
           "--lr_scheduler_type", "constant"]
    ref = tmp_path / "ref"
    torchrun(2, [*run, "--output_dir", str(ref)])
    records = read_jsonl(ref / "metrics.jsonl")
    plain = tmp_path / "plain"
    torchrun(2, [*run, "--output_dir", str(plain), "--sync_ref_model", "false", "--max_steps", "3"])
    unsynced = read_jsonl(plain / "metrics.jsonl")
    assert records[1]["kl"] == unsynced[1]["kl"] and records[2]["kl"] != unsynced[2]["kl"]  # the mix after step 2
    out = tmp_path / "out"
    shutil.copytree(ref, out, ignore=lambda folder, names: [n for n in names if n in ("step-00000006", "final",
                                                                                      "run.lock")])
    proc = torchrun(2, [*run, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert "step-00000003 at step 3" in proc.stderr, proc.stderr[-3000:]
    wa, wb = weights(ref), weights(out)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(records)
