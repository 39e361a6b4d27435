"""Issue 18, as users meet it: every bad input is one line naming what is wrong, with exit code 2 before the
expensive work (1 for what goes wrong during a run), and nothing already written is lost.

One table: the exact input, the exit code, the words the message must contain. The cheap cases run in this
process (`grpo_recipe.train.main`; none of them may start a process group); the few that need a running engine run
as one process or under torchrun with 2 ranks. Files the user had before the run must be unchanged after it;
checkpoints written before a failure must still match their manifest.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import REPO, torchrun

from grpo_recipe.config.schema import Config
from grpo_recipe.dist.env import free_port, rank_env
from grpo_recipe.run.checkpoint import Checkpointer
from grpo_recipe.run.metrics import read_jsonl

QUICKSTART = str(REPO / "grpo_recipe/configs/quickstart.yaml")
SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
         "--max_completion_length", "8", "--disable_tqdm", "true", "--num_iterations", "1"]
PROMPTS = [{"prompt": f"TL;DR of post {i}: the cat sat on the mat."} for i in range(8)]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)



def fill(at_call: int, leave: int | Callable[[], int], inodes: bool = False) -> Callable[[Path], str]:
    """reward_funcs with an entry (weight 0) that fills the case's disk on its at_call-th call, leaving `leave`
    bytes (inodes) free: a disk that fills up while the run goes on."""
    def spec(ws: Path) -> str:
        room = leave() if callable(leave) else leave
        kwargs = f"{{path: {ws / 'disk' / 'ballast'}, at_call: {at_call}, leave: {room}, inodes: {str(inodes).lower()}}}"
        return f"[length, {{func: 'tests.reward_fixtures:fill_disk', weight: 0, kwargs: {kwargs}}}]"
    return spec


def first_save_room() -> int:
    """Free bytes that pass the check before the first save (Adam's 12 bytes per trained parameter) and hold the
    first metrics line, but not the checkpoint itself (DeepSpeed's model-state file comes on top): the disk
    fills in the middle of torch's write."""
    from safetensors.torch import load_file

    from grpo_recipe.model.tiny import ensure_builtin

    params = sum(t.numel() for t in load_file(ensure_builtin("builtin:tiny-qwen2") / "model.safetensors").values())
    return 12 * params + 3 * 4096


def corrupt_newest_checkpoint(ws: Path, request) -> None:
    """The shared hub_run's outputs (and its hub cache), with one byte of its newest checkpoint flipped: the
    same size, so only the checksum can tell."""
    import shutil

    src, *_ = request.getfixturevalue("hub_run")
    shutil.copytree(src / "hub", ws / "hub")
    shutil.copytree(src / "run", ws / "run")
    victim = ws / "run/checkpoints/step-00000002/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def resumed_past_the_corrupt_one(out: Path) -> None:
    checkpoints_intact(out, [1, 2])  # step 2 trained again and saved over the corrupt copy
    assert (out / "final" / "model.safetensors").exists()


def fp32_weights(checkpoint: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from grpo_recipe.tools.export import _weights_only_torch_load

    with _weights_only_torch_load():
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="ds")


def skipped_then_stopped(out: Path) -> None:
    checkpoints_intact(out, [1, 2])
    assert [r["nonfinite_steps"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]  # step 2 skipped, logged
    # the skipped step changed no weight: step 2's checkpoint holds step 1's weights
    one, two = (fp32_weights(out / "checkpoints" / f"step-{s:08d}") for s in (1, 2))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def stopped_at_the_first(out: Path) -> None:
    checkpoints_intact(out, [1])
    assert not (out / "final").exists()


def silent_server(ws: Path, request) -> None:
    """A hub that accepts connections and never answers (a firewall that drops, a hung proxy); its port in
    ws/silent_port."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    request.addfinalizer(server.close)
    (ws / "silent_port").write_text(str(server.getsockname()[1]))


def tokenizer_without_eos(ws: Path, request) -> None:
    """The tiny model with its tokenizer's EOS token taken out (completions could never stop)."""
    import shutil

    shutil.copytree(request.getfixturevalue("tiny_model_dir"), ws / "noeos")
    path = ws / "noeos" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["eos_token"] = config["pad_token"] = None
    path.write_text(json.dumps(config))


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small real filesystem (root only: CI runs as root), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.fail("this case mounts a small tmpfs and needs root (CI runs the tests as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def read_only(path: Path):
    """A folder nobody can write to: a read-only mount as root (root ignores permission bits), else mode 0555."""
    if os.geteuid() == 0:
        with tmpfs(path, "ro,size=1m"):
            yield
        return
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    try:
        yield
    finally:
        path.chmod(0o755)


def snapshot(root: Path, *skip: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under root but those under `skip`: (size, mtime, CRC-32)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and not any(s in p.parents for s in skip):
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, zlib.crc32(p.read_bytes()))
    return out


def checkpoints_intact(out: Path, steps: list[int]) -> None:
    """The checkpoints written before the failure are there and match their manifest; no partial one is left."""
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp", "step-"))) == \
        [f"step-{s:08d}" for s in steps]
    ck = Checkpointer(Config(output_dir=str(out)), 0, 1)
    for s in steps:
        assert ck._problem(root / f"step-{s:08d}", verify=True) is None
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")][:len(steps)] == steps


def final_left_out(out: Path, steps: int) -> None:
    """No partial final model is left, and the run's log is whole."""
    assert not any((out / name).exists() for name in ("final", "final.tmp"))
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, steps + 1))


@dataclass
class Case:
    name: str
    args: list  # after the config and SHORT: text ({ws}: the case's workspace, {port}: a closed port) or ws -> text
    code: int
    words: list[str]
    files: dict[str, str] = field(default_factory=dict)  # inputs written into the workspace first
    env: dict[str, str] = field(default_factory=dict)  # "" = unset
    ranks: int = 0  # 0: in this process; 1: one process; 2: torchrun with 2 ranks
    disk: str | None = None  # tmpfs options for the output folder's filesystem
    after: Callable[[Path], None] | None = None  # more checks on the output folder
    prepare: Callable | None = None  # (workspace, pytest request): outputs of an earlier run, before this one
    config: str = QUICKSTART


BAD_YAML = "max_steps: 3\nseed 4\nnum_generations: 4\n"
CASES = [
    # --- the model -------------------------------------------------------------------------------------
    Case("hub_name_offline_not_cached", ["--model_name_or_path", "nobody-xyz/missing-model"], 2,
         ["config error: model_name_or_path:", "nobody-xyz/missing-model", "neither a local folder nor in the hub cache", "HF_HUB_OFFLINE"],
         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "{ws}/hub"}),
    Case("hub_name_without_network", ["--model_name_or_path", "nobody-xyz/missing-model"], 2,
         ["config error: model_name_or_path:", "nobody-xyz/missing-model", "unreachable", "download it first"],
         env={"HF_HUB_OFFLINE": "", "HF_HUB_CACHE": "{ws}/hub", "HF_ENDPOINT": "http://127.0.0.1:{port}"}),
    Case("hub_answers_nothing", ["--model_name_or_path", "nobody-xyz/missing-model"], 2,
         ["config error: model_name_or_path:", "nobody-xyz/missing-model", "is unreachable (timed out)"],
         env={"HF_HUB_OFFLINE": "", "HF_HUB_CACHE": "{ws}/hub",
              "HF_ENDPOINT": lambda ws: f"http://127.0.0.1:{(ws / 'silent_port').read_text()}"},
         prepare=lambda ws, request: silent_server(ws, request)),
    Case("mistyped_path_two_levels", ["--model_name_or_path", "out/run/finl"], 2,
         ["config error: model_name_or_path: no such folder: out/run/finl"]),
    Case("mistyped_path_one_level", ["--model_name_or_path", "out/finl"], 2,
         ["config error: model_name_or_path: no such folder: out/finl"], files={"out/final/config.json": "{}"},
         env={"HF_HUB_OFFLINE": "", "HF_HUB_CACHE": "{ws}/hub", "HF_ENDPOINT": "http://127.0.0.1:{port}"}),
    Case("model_folder_without_tokenizer", ["--model_name_or_path", "m"], 2,
         ["config error: model_name_or_path: m is not a model folder: it has no tokenizer files"],
         files={"m/config.json": "{}", "m/model.safetensors": "x"}),
    Case("model_is_a_checkpoint", ["--model_name_or_path", "out/checkpoints/step-00000002"], 2,
         ["config error: model_name_or_path: out/checkpoints/step-00000002 is a recipe checkpoint",
          "python -m grpo_recipe.tools.export"], files={"out/checkpoints/step-00000002/meta.json": "{}",
                                             "out/checkpoints/step-00000002/ds/x.pt": "x"}),
    Case("tokenizer_without_eos", ["--model_name_or_path", "noeos"], 2,
         ["config error: model_name_or_path: no usable tokenizer in", "has no EOS token"], prepare=tokenizer_without_eos),
    # --- the output folder and the run's fields ------------------------------------------------------
    Case("output_dir_read_only", ["--output_dir", "{ws}/ro/run"], 2, ["config error: output_dir: cannot write in",
                                                                     "/ro"]),
    Case("output_dir_is_a_file", ["--output_dir", "{ws}/notes.txt"], 2,
         ["config error: output_dir:", "notes.txt is a file"], files={"notes.txt": "my notes\n"}),
    Case("disk_too_small_for_one_checkpoint", ["--save_steps", "1"], 2,
         ["config error: output_dir:", "has 4.0 MiB free, too little for one checkpoint", "a checkpoint needs about"],
         disk="size=4m"),  # the final model and the run's files fit (about 2.4 MiB), a checkpoint does not
    Case("disk_fits_one_checkpoint_not_the_limit_plus_one", ["--max_steps", "1", "--save_steps", "1",
                                                            "--save_total_limit", "2"], 0,
         ["warning: output_dir", "has 8.0 MiB free, less than the save_total_limit + 1 = 3 checkpoints a save may need"],
         disk="size=8m", ranks=1, after=lambda out: checkpoints_intact(out, [1])),
    Case("disk_too_small_for_the_final_model", ["--save_steps", "0"], 2,
         ["config error: output_dir:", "has 1.0 MiB free, too little for the final model"], disk="size=1m"),
    Case("deepspeed_config_not_json", ["--deepspeed_config", "{ws}/ds.json"], 2,
         ["config error: deepspeed_config:", "ds.json is not valid JSON: line 3, column 3"],
         files={"ds.json": '{\n  "zero_optimization": {"stage": 3},\n  }\n'}),
    Case("resume_from_a_mistyped_checkpoint", ["--resume_from_checkpoint", "{ws}/run/checkpoints/step-5"], 2,
         ["config error: resume_from_checkpoint: no such folder:", "step-5"]),
    Case("negative_seed", ["--seed", "-1"], 2, ["config error: seed: must be in [0,", "got -1"]),
    # --- the data ------------------------------------------------------------------------------------
    Case("empty_prompt_string", ["--dataset_name", "{ws}/p.jsonl"], 2,
         ["error: prompt_column: row 3 of", "p.jsonl", "empty 'prompt'"],
         files={"p.jsonl": jsonl(PROMPTS[:3] + [{"prompt": ""}] + PROMPTS[4:])}),
    Case("null_prompt", ["--dataset_name", "{ws}/p.jsonl"], 2, ["error: prompt_column: row 2 of", "(null)"],
         files={"p.jsonl": jsonl(PROMPTS[:2] + [{"prompt": None}] + PROMPTS[3:])}),
    Case("chat_messages_without_a_chat_template", ["--dataset_name", "{ws}/chat.jsonl"], 2,
         ["error: prompt_column: row 0 of", "chat messages", "has no chat template"],
         files={"chat.jsonl": jsonl([{"prompt": [{"role": "user", "content": f"hi {i}"}]} for i in range(8)])}),
    Case("empty_jsonl", ["--dataset_name", "{ws}/empty.jsonl"], 2, ["error: dataset_name:", "empty.jsonl is empty"],
         files={"empty.jsonl": ""}),
    # --- the config file and the rewards -------------------------------------------------------------
    Case("empty_config_file", [], 2, ["config error: config file", "empty.yaml is empty"],
         files={"empty.yaml": "# nothing yet\n"}, config="{ws}/empty.yaml"),
    Case("yaml_syntax_error", [], 2, ["config error: config file", "bad.yaml", "line 3, column 1",
                                      "could not find expected ':'"], files={"bad.yaml": BAD_YAML},
         config="{ws}/bad.yaml"),
    Case("misspelled_builtin_reward_kwarg", ["--reward_funcs", "[{func: length, kwargs: {target_char: 50}}]"], 2,
         ["config error: reward_funcs: 'length' has no argument 'target_char'", "did you mean 'target_chars'"]),
    # --- during the run (exit 1): the earlier checkpoints stay -----------------------------------------
    Case("disk_fills_during_first_checkpoint", ["--save_steps", "1", "--reward_funcs", fill(1, first_save_room)], 1,
         ["error (rank 0): checkpoint", ".tmp-step-00000001 could not be written: the disk is full", "removed it",
          "no earlier checkpoint to keep", "a checkpoint needs about"], ranks=1, disk="size=24m",
         after=lambda out: checkpoints_intact(out, [])),
    Case("disk_runs_out_of_inodes_during_a_checkpoint", ["--max_steps", "3", "--save_steps", "1",
                                                         "--save_total_limit", "0", "--reward_funcs",
                                                         fill(2, 3, inodes=True)], 1,
         ["checkpoint", ".tmp-step-00000002 could not be written: the disk is full (no free inodes)",
          "removed it, kept step-00000001", "save_total_limit 0 keeps every one"], ranks=2,
         disk="size=64m,nr_inodes=200", after=lambda out: checkpoints_intact(out, [1])),
    Case("disk_fills_before_the_final_save", ["--max_steps", "2", "--num_iterations", "1", "--save_steps", "0",
                                               "--reward_funcs", fill(2, 64 << 10)], 1,
         ["error (rank 0): the final model could not be written to", "removed the partial folder",
          "no checkpoint holds this run (save_steps: 0 keeps none)"], ranks=1, disk="size=24m",
         after=lambda out: final_left_out(out, 2)),
    Case("reward_overflows_float32", ["--reward_funcs", "[tests.reward_fixtures:huge]"], 1,
         ["reward error (rank 0): reward 'huge' returned 1e+308 at sample 1, which overflows float32"], ranks=1),
    Case("loss_not_finite", ["--max_steps", "4", "--num_iterations", "4", "--learning_rate", "1e30",
                             "--save_steps", "1", "--skip_nonfinite_steps", "1"], 1,
         ["error (rank 0): loss = nan", "at optimizer step 3", "2 non-finite step(s), skip_nonfinite_steps allows 1",
          "the update was not applied"], ranks=1, after=skipped_then_stopped),
    Case("loss_not_finite_by_default", ["--max_steps", "4", "--num_iterations", "4", "--learning_rate", "1e30",
                                        "--save_steps", "1"], 1,
         ["error (rank 0): loss = nan", "at optimizer step 2", "1 non-finite step(s), skip_nonfinite_steps allows 0",
          "the update was not applied"], ranks=1, after=stopped_at_the_first),
    Case("reward_calls_sys_exit_on_one_rank", ["--reward_funcs", "[tests.reward_fixtures:exits_on_rank1]"], 1,
         ["reward error (rank 0): reward 'exits_on_rank1' called sys.exit(3) (on rank 1)",
          "reward error (rank 1): reward 'exits_on_rank1' called sys.exit(3)"], ranks=2),
    # --- resuming (exit 0): a warning, and the previous complete checkpoint -----------------------------
    Case("checkpoint_corrupted_without_changing_its_size",
         ["--model_name_or_path", "org/tiny", "--save_steps", "1", "--save_total_limit", "0",
          "--resume_from_checkpoint", "auto"], 0,
         ["warning: skipping checkpoint", "step-00000002: file ds/zero_pp_rank_0_mp_rank_00_optim_states.pt does "
          "not match its checksum (corrupt)", "resumed from", "step-00000001 at step 1"],
         env={"HF_HUB_OFFLINE": "", "HF_HUB_CACHE": "{ws}/hub", "HF_ENDPOINT": "http://127.0.0.1:{port}"}, ranks=1,
         prepare=corrupt_newest_checkpoint, after=resumed_past_the_corrupt_one),
]
SLOW = {c.name for c in CASES if c.ranks}


def expand(arg, ws: Path, port: int) -> str:
    return arg(ws) if callable(arg) else arg.replace("{ws}", str(ws)).replace("{port}", str(port))


ERROR_LINE = re.compile(r"^(config |reward )?error( \(rank \d+\))?: ")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW else [])
                                  for c in CASES])
def test_bad_input_is_one_named_line(case: Case, tmp_path, monkeypatch, capsys, request):
    ws, port = tmp_path, free_port()
    if case.prepare is not None:
        case.prepare(ws, request)
    for rel, text in case.files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    out = ws / ("disk/run" if case.disk else "run")
    argv = ["--config", expand(case.config, ws, port), *SHORT, "--output_dir", str(out),
            *[expand(a, ws, port) for a in case.args]]
    env = {k: expand(v, ws, port) for k, v in case.env.items()}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if case.disk:
            stack.enter_context(tmpfs(ws / "disk", case.disk))
        if case.name == "output_dir_read_only":
            stack.enter_context(read_only(ws / "ro"))
        ballast = ws / "disk" / "ballast"  # what the test itself fills the disk with
        before = snapshot(ws, out, ballast)
        code, err = run(case, argv, env, ws, monkeypatch, capsys)
        assert code == case.code, err[-4000:]
        errors = [line for line in err.splitlines() if ERROR_LINE.match(line)]
        assert len(errors) == (max(case.ranks, 1) if case.code else 0), err[-4000:]  # one line (per rank)
        for word in case.words:  # said in that line (a resumed run's warnings: anywhere)
            assert any(word in line for line in (errors if case.code else [err])), f"{word!r} not in:\n{err[-4000:]}"
        if case.code == 2 and not case.ranks:  # refused before any expensive work: seconds, not minutes
            assert time.monotonic() - started < 30, f"{case.name} took {time.monotonic() - started:.0f} s"
        assert f'File "{REPO / "recipe"}' not in err, err[-4000:]  # no traceback through the recipe
        assert snapshot(ws, out, ballast) == before  # the user's files are untouched
        if case.after is not None:
            case.after(out)
        elif case.code == 2:
            assert not out.exists() or not any(out.iterdir())  # refused before anything was written


def run(case: Case, argv: list[str], env: dict, ws: Path, monkeypatch, capsys) -> tuple[int, str]:
    if case.ranks == 0:  # in this process: each case must fail before any process group or model
        import torch.distributed as dist

        from grpo_recipe.train import main

        monkeypatch.chdir(ws)
        for k, v in env.items():
            monkeypatch.setenv(k, v) if v else monkeypatch.delenv(k, raising=False)
        capsys.readouterr()
        code = main(argv)
        assert not dist.is_initialized()
        return code, capsys.readouterr().err
    full_env = {k: v for k, v in {**rank_env(), **env}.items() if v}
    if case.ranks == 2:  # torchrun ends with 1 whatever a rank's code (launch/local.sh keeps 2: test_launch.py)
        proc = torchrun(2, ["-m", "grpo_recipe.train", *argv], check=False, timeout=900,
                        **{k: v for k, v in env.items() if v})
    else:
        proc = subprocess.run([sys.executable, "-m", "grpo_recipe.train", *argv], cwd=ws, env=full_env,
                              capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stderr


# --- the run that the shared hub_run fixture made --------------------------------------------------------------
@pytest.mark.slow
def test_a_cached_hub_model_trains_offline_when_the_hub_is_unreachable(hub_run):
    ws, _, env, err = hub_run
    assert f"note: {env['HF_ENDPOINT']} is unreachable" in err and "using the cached org/tiny offline" in err
    assert [r["step"] for r in read_jsonl(ws / "run" / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_final_follows_the_umask_and_checkpoints_ship_no_pickle_converter(hub_run):
    ws, *_ = hub_run
    final = ws / "run" / "final"
    modes = {p.name: p.stat().st_mode & 0o777 for p in [final, *final.iterdir()]}
    assert modes == {"final": 0o750, **{p.name: 0o640 for p in final.iterdir()}}, modes  # umask 027
    for ckpt in (ws / "run" / "checkpoints").glob("step-*"):
        assert not list(ckpt.rglob("zero_to_*.py"))  # DeepSpeed's converter unpickles with weights_only=False
