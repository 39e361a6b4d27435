"""generation/environments.py: TRL 1.16's environment_factory semantics (one instance per completion, reset from its
row, its methods its tools, get_reward a reward of weight 1), one-line errors, and the env quickstart end to end:
2 ranks whose reward rises, and a SIGKILL mid-run resumed bit-identically."""
import os
import signal
import random as pyrandom

import pytest
import torch
from conftest import torchrun
from procs import wait_for_step
from test_checkpoint import comparable, signal_tree, start, weights

from grpo_recipe.generation.environments import Environments
from grpo_recipe.generation.tools import ToolError, load_tools
from grpo_recipe.run.metrics import read_jsonl

HERE = os.path.dirname(__file__)
ENVS = os.path.join(HERE, "data", "envs_fixture.py")


def test_one_reset_instance_per_completion_shown_its_observation_and_pooled():
    envs = Environments(f"{ENVS}:Dice", [])
    prompts = [[{"role": "user", "content": "roll"}]] * 3
    got, shown = envs.start(prompts, {"level": [1, 2, 3]}, "prompt", seed=5)
    assert len({id(e) for e in got}) == 3  # isolated: one per completion
    assert [e.row for e in got] == [{"prompt": prompts[0], "level": k} for k in (1, 2, 3)]  # reset(**row)
    assert [m[-1]["content"] for m in shown] == [f"roll (target {e.target})" for e in got]
    targets, ids = [e.target for e in got], [id(e) for e in got]
    again, _ = envs.start(prompts, {"level": [1, 2, 3]}, "prompt", seed=5)
    assert [id(e) for e in again] == ids  # constructed once, reset often
    assert [e.target for e in again] == targets  # the same seed draws the same tasks
    other, _ = envs.start(prompts, {"level": [1, 2, 3]}, "prompt", seed=6)
    assert [e.target for e in other] != targets
    tools = envs.tools_of(got[0])
    assert set(tools) == {"roll"} and tools["roll"](times=2) == "2" and got[0].rolls == 2
    assert envs.schemas[None][0]["function"]["name"] == "roll"


def test_a_mapping_picks_each_examples_environment_and_only_its_tools():
    envs = Environments({"dice": f"{ENVS}:Dice", "quiet": f"{ENVS}:Quiet"}, load_tools(
        [os.path.join(HERE, "data", "tools_fixture.py") + ":add"]))
    columns = {"environment": ["quiet", "dice", "quiet"]}
    got, shown = envs.start(["a", "b", "c"], columns, "prompt", seed=0)
    assert [type(e).__name__ for e in got] == ["Quiet", "Dice", "Quiet"]
    assert "environment" not in got[1].row  # a control column, not the environment's
    assert shown[0] == "a" and shown[1][-1]["content"].startswith("b (target")  # a text prompt becomes a message
    names = [[s["function"]["name"] for s in schemas] for schemas in envs.schemas_of(columns, 3)]
    assert names == [["add", "ping"], ["add", "roll"], ["add", "ping"]]
    (name, reward), = envs.reward_funcs()  # only Dice scores; the others' completions are not its business
    assert name == "Dice" and reward(got) == [None, 0.0, None]
    with pytest.raises(ToolError, match=r"environment\(s\) \['maze'\]"):
        envs.start(["a"], {"environment": ["maze"]}, "prompt", seed=0)
    with pytest.raises(ToolError, match="needs an 'environment' column"):
        envs.start(["a"], {}, "prompt", seed=0)


@pytest.mark.parametrize("spec, says", [
    ("NoReset", "NoReset has no reset method"),
    ("Undocumented", "Undocumented.act has no usable schema"),
    ("Broken", "Broken() failed: RuntimeError: cannot open the board"),
    ("Missing", "has no function 'Missing'"),
])
def test_an_unusable_environment_is_one_line_naming_it(spec, says):
    with pytest.raises(ToolError) as e:
        Environments(f"{ENVS}:{spec}", [])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_reset_that_raises_is_one_line_naming_the_environment_and_the_sample():
    envs = Environments(f"{ENVS}:BadReset", [])
    with pytest.raises(ToolError, match="environment BadReset: reset failed on sample 0: KeyError"):
        envs.start(["a"], {}, "prompt", seed=0)


# --- the env quickstart end to end --------------------------------------------------------------------------
QUICKSTART = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_env.yaml", "--disable_tqdm", "true"]


@pytest.mark.slow
def test_the_env_quickstart_learns_and_counts_its_tool_calls(tmp_path):
    out = tmp_path / "out"
    torchrun(2, [*QUICKSTART, "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    quarter = len(records) // 4
    first = sum(r["reward_mean"] for r in records[:quarter]) / quarter
    last = sum(r["reward_mean"] for r in records[-quarter:]) / quarter
    assert last > first + 0.15, (first, last)  # the lamp ends on more often
    assert all(r["reward/Lamp"] == r["reward_mean"] for r in records)  # get_reward is the reward
    assert all(r["tool_calls_per_completion"] > 0 for r in records)
    assert all(0 < r["tool_tokens_per_completion"] < r["completion_length_mean"] for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["env", "tools"])
def test_a_sigkilled_multi_turn_run_resumes_bit_identically(tmp_path, config):
    """Both multi-turn quickstarts, 10 steps at mu 2, killed mid-run; the env run also evaluates (with its
    environment) at steps 0, 5 and 10."""
    run = [*QUICKSTART[:3], f"grpo_recipe/configs/quickstart_{config}.yaml", *QUICKSTART[4:], "--max_steps", "10",
           "--save_steps", "3", "--save_total_limit", "0"]
    if config == "env":
        run += ["--eval_steps", "5", "--eval_on_start", "true", "--eval_holdout_size", "4", "--eval_num_generations", "2"]
    ref = tmp_path / "ref"
    torchrun(2, [*run, "--output_dir", str(ref)])
    out = tmp_path / "out"
    kill_after = pyrandom.Random().choice([4, 5, 7])  # mid rollout (mu = 2) or at its end
    proc = start(out, run=run)
    wait_for_step(proc, out, kill_after)
    signal_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    torchrun(2, [*run, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = comparable(read_jsonl(ref / "metrics.jsonl")), comparable(read_jsonl(out / "metrics.jsonl"))
    assert ra == rb and [r["step"] for r in rb if "reward_mean" in r] == list(range(1, 11))
    assert sum(r.get("tool_calls_per_completion", 0) for r in rb) > 0
    if config == "env":
        evals = [r for r in rb if "eval/greedy/reward/Lamp" in r]  # evaluated with the environment, as trained
        assert [r["step"] for r in evals] == [0, 5, 10] and all(0 <= r["eval/sampled/reward/Lamp"] <= 1 for r in evals)


def test_grporun_takes_tools_and_environments_as_python_objects_and_records_their_names():
    from grpo_recipe import GRPORun
    from grpo_recipe.examples.tool_games import Lamp, secret_word

    run = GRPORun("grpo_recipe/configs/quickstart_env.yaml", environment_factory={"lamp": Lamp}, tools=[secret_word])
    assert run.config.environment_factory == {"lamp": Lamp} and run.config.tools == [secret_word]
    named = run.config.to_dict()  # what a checkpoint records and compares on resume
    assert named["environment_factory"] == {"lamp": "grpo_recipe.examples.tool_games:Lamp"}
    assert named["tools"] == ["grpo_recipe.examples.tool_games:secret_word"]
    envs = Environments(run.config.environment_factory, load_tools(run.config.tools))
    assert [s["function"]["name"] for s in envs.schemas["lamp"]] == ["secret_word", "switch"]
