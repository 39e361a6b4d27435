"""This recipe against TRL's GRPOTrainer: the same GRPO run on both, alternating, timed from their own logs.

    python bench/vs_trl.py                       # mu 1 and 4, 2 repetitions each -> bench/results/vs_trl.{json,png}
    python bench/vs_trl.py --mus 1 --reps 1 --steps 6 --out /tmp/vt   # a quick look
    python bench/vs_trl.py --trl_zero recipe     # TRL with the recipe's ZeRO sizes -> vs_trl_recipe_zero.{json,png}

Both sides get the recipe config (default grpo_recipe/configs/quickstart.yaml, plus --set overrides): the same model
folder, tokenizer, prompt file, reward functions, group size, batch shape, completion length, sampling, mu,
learning rate, loss, clipping and ZeRO-3 config, 2 ranks under torchrun with OMP_NUM_THREADS=1 each, generation
with transformers' generate. Needs trl (pinned in the `bench-trl` extra: `pip install -e '.[bench-trl]'`).
Timings exclude start-up: they come from each run's per-step timestamps, skipping its first rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
TRL_PIN = "1.16.0"

FAIRNESS = [
    "Same model folder (builtin:tiny-qwen2), tokenizer, prompt file and reward functions (TRL calls the recipe's own "
    "reward code through a thin wrapper).",
    "Same prompts in tokens: TRL 1.16 has no max_prompt_length, so the prompt file given to both is the recipe's "
    "left-truncation to max_prompt_length tokens, decoded; it re-tokenizes to identical ids (checked) and the "
    "recipe's own truncation is then a no-op. Prompt order differs (each side shuffles with its own sampler).",
    "Same batch shape: TRL per_device_train_batch_size and gradient_accumulation_steps as ours, TRL "
    "steps_per_generation = our optimizer_steps_per_pass x gradient_accumulation_steps (TRL counts micro-batches, "
    "we optimizer steps), num_generations = G, num_iterations = mu; checked by counting generations, completions per generation "
    "and optimizer steps in both logs.",
    "Same generation backend and sampling: transformers generate on the ZeRO-3 weights gathered once per rollout "
    "(TRL use_vllm=False, ds3_gather_for_generation=True, its default), same temperature, top_p, top_k, "
    "max_completion_length.",
    "Same optimization: loss_type, epsilon, beta, learning rate held constant (TRL lr_scheduler_type=constant; the "
    "recipe has no schedule), AdamW (DeepSpeed's, torch implementation on CPU on both) with the same betas, eps and "
    "weight decay, gradient clipping, fp32 on CPU (TRL bf16=False), no gradient checkpointing on either "
    "(TRL's default is on; the recipe's config says off), dropout off on both.",
    "Same DeepSpeed ZeRO-3 config file: the recipe's ds_configs file; TRL gets it through "
    "TrainingArguments(deepspeed=...) and accelerate, which fills the 'auto' values it knows its own way "
    "(stage3_param_persistence_threshold = 10 x hidden on both, so ZeRO-3 really shards; bucket sizes hidden^2, "
    "where the recipe takes at least 2^21; batch sizes), as a TRL user gets them; the two it does not know "
    "(stage3_max_live_parameters, stage3_max_reuse_distance) get the recipe's values. The JSON lists every "
    "difference.",
    "Same launcher and threads: torchrun --nproc_per_node 2, OMP_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false "
    "per rank, DS_ACCELERATOR=cpu, gloo, "
    "the same Python environment; runs alternate ours, TRL, ours, TRL so load drifts hit both.",
    "Same logging and no saving: both log every step (recipe logging_steps=1, TRL logging_steps=1), progress bars "
    "as by default, no checkpoints (recipe save_steps=0, TRL save_strategy=no), no evaluation. TRL's own extras "
    "(entropy and clip statistics, metric gathering) stay as a TRL user gets them.",
    "Timing: seconds per optimizer step and per rollout from each run's own per-step timestamps (recipe: "
    "metrics.jsonl step_time_s; TRL: a TrainerCallback.on_step_end clock), skipping the first rollout (warm-up); "
    "process start-up is excluded. Generation alone: the recipe's time_generate_s, TRL's _generate_single_turn "
    "timed by a wrapper.",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="grpo_recipe/configs/quickstart.yaml", help="recipe config both sides follow")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe config override (repeatable)")
    p.add_argument("--mus", type=int, nargs="+", default=[1, 4], help="num_iterations values (default: 1 4)")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions per mu (default: 2)")
    p.add_argument("--steps", type=int, default=20,
                   help="optimizer steps per run, rounded up to whole rollouts, at least 2 rollouts (default: 20)")
    p.add_argument("--python", default=sys.executable, help="interpreter with the recipe's deps and trl (default: this)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for vs_trl.json and vs_trl.png")
    p.add_argument("--trl_zero", choices=("accelerate", "recipe"), default="accelerate",
                   help="TRL's ZeRO 'auto' sizes: accelerate's own, as a TRL user gets them (default), or the "
                        "recipe's resolved values for every one (writes vs_trl_recipe_zero.json and .png)")
    p.add_argument("--workdir", default=None, help="keep run folders and logs here (default: a temp folder, removed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run is killed (default: 900)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------
# checks and set-up
# ------------------------------------------------------------------------------------------
def trl_version(python: str) -> str:
    """trl's version in `python`, or exit 2 with how to install it."""
    r = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"vs_trl: trl is not installed for {python}; install the pinned version with "
                 f"`pip install -e '.[bench-trl]'` (trl=={TRL_PIN}) or pass --python with an environment that has it")
    return r.stdout.strip().splitlines()[-1]


def recipe_config(args, world_size: int = 2):
    from grpo_recipe.config.load import load_config
    from grpo_recipe.run.preflight import preflight

    argv = ["--config", args.config]
    for kv in args.set:
        key, eq, value = kv.partition("=")
        if not eq:
            sys.exit(f"vs_trl: --set {kv!r}: expected KEY=VALUE")
        argv += [f"--{key}", value]
    cfg = load_config(argv, world_size=world_size)
    preflight(cfg)
    return cfg


def steps_for(steps: int, steps_per_rollout: int) -> int:
    """Whole rollouts, at least two (the first one is warm-up and not timed)."""
    return max(2, -(-steps // steps_per_rollout)) * steps_per_rollout


def write_prompts(cfg, tokenizer, path: Path) -> int:
    """The recipe's left-truncated prompts as text that re-tokenizes to the same ids; returns their count."""
    from grpo_recipe.data.prompts import load_prompt_dataset

    if getattr(tokenizer, "chat_template", None) is not None and str(cfg.chat_template).lower() != "false":
        sys.exit("vs_trl: the model's tokenizer has a chat template; this benchmark compares plain-text prompts only")
    rows = load_prompt_dataset(cfg)[cfg.prompt_column]
    with path.open("w") as f:
        for text in rows:
            ids = tokenizer(str(text))["input_ids"][-cfg.max_prompt_length:]
            cut = tokenizer.decode(ids)
            if tokenizer(cut)["input_ids"] != ids:
                sys.exit(f"vs_trl: a prompt does not survive truncate-decode-retokenize: {cut[:60]!r}...")
            f.write(json.dumps({"prompt": cut}) + "\n")
    return len(rows)


def trl_fields(cfg, mu: int, max_steps: int, cuda: bool) -> dict:
    """GRPOConfig fields for the same run as the recipe config with num_iterations = mu."""
    return dict(
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        steps_per_generation=cfg.optimizer_steps_per_pass * cfg.gradient_accumulation_steps,
        num_generations=cfg.num_generations, num_iterations=mu, max_steps=max_steps,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, use_vllm=False,
        loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
        scale_rewards=cfg.scale_rewards, mask_truncated_completions=cfg.mask_truncated_completions,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm,
        bf16=cuda and str(cfg.bf16).lower() != "false", gradient_checkpointing=cfg.gradient_checkpointing,
        disable_dropout=True, seed=cfg.seed, logging_steps=cfg.logging_steps, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=cfg.disable_tqdm)


ACCELERATE_FILLS = {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"}


def trl_ds_config(cfg, cuda: bool, ours: dict, all_zero: bool = False) -> dict:
    """The recipe's DeepSpeed file as TRL's Trainer takes it (it fills the "auto" values itself).

    Two changes: the one the recipe makes at run time on CPU (torch's fused AdamW instead of a compiled kernel),
    and the ZeRO fields left "auto" that accelerate does not fill (how many parameters stay gathered), which get
    the recipe's values from `ours`, its resolved config; with `all_zero`, every ZeRO "auto" field does.
    """
    from grpo_recipe.config.schema import resolve_path

    conf = json.loads(resolve_path(cfg.deepspeed_config).read_text())
    opt = conf.get("optimizer")
    if not cuda and opt is not None and opt.get("type", "").lower() in ("adam", "adamw"):
        opt.setdefault("params", {}).update(torch_adam=True, fused=True)
    zero = conf.get("zero_optimization", {})
    for k, v in zero.items():
        if v == "auto" and (all_zero or k not in ACCELERATE_FILLS):
            zero[k] = ours["zero_optimization"][k]
    return conf


def ds_differences(ours: dict, trl: dict) -> list[str]:
    """Fields that matter for the comparison and differ between the two resolved DeepSpeed configs."""
    keys = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"]
    diffs = [f"{k}: ours {ours.get(k)} vs TRL {trl.get(k)}" for k in keys if ours.get(k) != trl.get(k)]
    zo, zt = ours.get("zero_optimization", {}), trl.get("zero_optimization", {})
    diffs += [f"zero_optimization.{k}: ours {zo.get(k)} vs TRL {zt.get(k)}" for k in sorted(set(zo) | set(zt))
              if zo.get(k) != zt.get(k)]
    for k in ("optimizer", "bf16"):
        a, b = ours.get(k) or {}, trl.get(k) or {}
        if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            diffs.append(f"{k}: ours {a} vs TRL {b}")
    return diffs


# ------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------
def run_env() -> dict:
    import torch

    from grpo_recipe.dist.env import rank_env

    # both sides load DeepSpeed's CPU comm op from the interpreter's own environment (grpo_recipe/dist/buildlock.py)
    return rank_env(None if torch.cuda.is_available() else "cpu")


def launch(cmd: list[str], env: dict, log: Path, timeout: float) -> float:
    """Run one job to completion (its output to `log`); returns its wall-clock seconds, start-up included."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        # a rank's own error line, above torchrun's summary that names no cause
        cause = [x for x in lines if ("Error" in x or "error:" in x) and "ChildFailedError" not in x
                 and "torch/distributed" not in x][:6]
        sys.exit(f"vs_trl: run failed ({rc}): {' '.join(cmd)}\n--- error lines of {log} ---\n" + "\n".join(cause)
                 + "\n--- last lines ---\n" + "\n".join(lines[-25:]))
    return time.perf_counter() - t0


def commands(args, python: str, cfg_path: str, prompts: Path, run_dir: Path, mu: int, steps: int,
             spec: Path) -> dict[str, list[str]]:
    from grpo_recipe.dist.env import torchrun

    overrides = [x for kv in args.set for x in ("--" + kv.partition("=")[0], kv.partition("=")[2])]
    ours = torchrun(2, ["-m", "grpo_recipe.train", "--config", cfg_path, *overrides, "--dataset_name", str(prompts),
                        "--num_iterations", str(mu), "--max_steps", str(steps), "--save_steps", "0",
                        "--overwrite_output_dir", "true", "--output_dir", str(run_dir / "ours")], python=python)
    return {"ours": ours, "trl": torchrun(2, [str(REPO / "bench" / "trl_runner.py"), str(spec)], python=python)}


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------
def versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
            "('trl', 'torch', 'transformers', 'accelerate', 'deepspeed', 'datasets')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv=None) -> int:
    args = parse_args(argv)
    # The recipe's configs name repo-relative files (prompts, DeepSpeed config), so work from the repo root;
    # the caller's own paths are made absolute first (a --config not found here is taken from the repo root).
    args.out = str(Path(args.out).resolve())
    args.workdir = str(Path(args.workdir).resolve()) if args.workdir else None
    if Path(args.config).exists():
        args.config = str(Path(args.config).resolve())
    os.chdir(REPO)
    try:
        import matplotlib  # noqa: F401  (checked before minutes of runs, used at the end)
    except ImportError:
        sys.exit("vs_trl: matplotlib is missing (for the plot); `pip install -e '.[bench-trl]'` installs it")
    version = trl_version(args.python)
    if version != TRL_PIN:
        print(f"vs_trl: warning: trl {version} found, the benchmark is pinned to {TRL_PIN}", file=sys.stderr)
    import torch
    from common import machine
    from transformers import AutoConfig
    from vs_trl_logs import (
        REWARD_WINDOW,
        markdown_table,
        plot,
        read_ours,
        read_trl,
        reward_at_budget,
        summarize,
        summarize_run,
    )

    from grpo_recipe.model import engine as eng
    from grpo_recipe.model.load import load_tokenizer
    from grpo_recipe.model.source import model_path

    cfg, cuda, world = recipe_config(args), torch.cuda.is_available(), 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="vs_trl."))
    work.mkdir(parents=True, exist_ok=True)
    model = model_path(cfg)
    prompts = work / "prompts.jsonl"
    n_prompts = write_prompts(cfg, load_tokenizer(model), prompts)
    ds_path = work / "ds_config_trl.json"
    ours_ds = eng.ds_config(cfg, world, AutoConfig.from_pretrained(model).hidden_size)
    ds_path.write_text(json.dumps(trl_ds_config(cfg, cuda, ours_ds, all_zero=args.trl_zero == "recipe"), indent=1))
    env, info, runs, cmds = run_env(), machine(load_average_at_start=os.getloadavg()), [], {}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for mu in args.mus:
            spr = mu * cfg.optimizer_steps_per_pass
            steps = steps_for(args.steps, spr)
            run_dir = work / f"mu{mu}-rep{rep}"
            spec = run_dir / "trl_spec.json"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(json.dumps({
                "output_dir": str(run_dir / "trl"), "model": model, "prompts_file": str(prompts),
                "deepspeed_config": str(ds_path), "reward_funcs": cfg.reward_funcs,
                "grpo_config": trl_fields(cfg, mu, steps, cuda)}, indent=1))
            cmd = commands(args, args.python, args.config, prompts, run_dir, mu, steps, spec)
            cmds.setdefault(str(mu), cmd)
            for impl in ("ours", "trl"):  # alternate: ours, TRL, ours, TRL, ...
                print(f"vs_trl: rep {rep} mu {mu} {impl} ({steps} steps)", file=sys.stderr, flush=True)
                wall = launch(cmd[impl], env, run_dir / f"{impl}.log", args.timeout)
                parsed = (read_ours(run_dir / "ours", spr) if impl == "ours"
                          else read_trl(run_dir / "trl", spr, world))
                run = {"impl": impl, "mu": mu, "rep": rep, "max_steps": steps, **summarize_run(parsed, spr)}
                run.update(process_wall_s=wall, startup_and_teardown_s=wall - run["train_span_s"], **parsed)
                runs.append(run)
            ours_run, trl_run = runs[-2], runs[-1]
            budget = min(ours_run["train_span_s"], trl_run["train_span_s"])
            for r in (ours_run, trl_run):
                r["budget_s"] = budget
                r["reward_at_budget"] = reward_at_budget(r["rollout_times"], r["rollout_rewards"], budget)
    # verification: the mapping gave both sides the same work
    expect = {}
    for r in runs:
        spr = r["mu"] * cfg.optimizer_steps_per_pass
        e = {"optimizer_steps": r["max_steps"], "generations": r["max_steps"] // spr}
        got = {k: r[k] for k in e}
        if r["impl"] == "trl":
            e["completions_per_generation"] = [cfg.completions_per_rollout * world]
            got["completions_per_generation"] = r["completions_per_generation"]
        expect[f"{r['impl']} mu={r['mu']} rep={r['rep']}"] = {"expected": e, "counted": got, "ok": e == got}
    trl_ds = json.loads((work / f"mu{args.mus[0]}-rep0" / "trl" / "ds_config_resolved.json").read_text())
    summary = summarize(runs, args.mus)
    result = {
        "benchmark": "vs_trl", "trl_version": version, "versions": versions(args.python),
        "step_time_ratio": summary["step_time_ratio"], "rollout_time_ratio": summary["rollout_time_ratio"],
        "generate_time_ratio": summary["generate_time_ratio"], "by_mu": summary["by_mu"],
        "ratio_definition": "ours / TRL; each ratio is the median over repetitions (and, top level, over mu) of the "
                            "ratio of two adjacent runs with the same mu. < 1 means this recipe is faster.",
        "reward_definition": f"reward_at_budget: mean reward of the last {REWARD_WINDOW} rollouts scored within the "
                             "budget = the shorter training span of the two paired runs. Rewards here are negative "
                             "(-|target - length|), so reward ratio < 1 and difference (ours - TRL) > 0 mean ours is "
                             "nearer the target.",
        "machine": {**info, "load_average_at_end": os.getloadavg()},
        "benchmark_wall_s": time.perf_counter() - t_start,
        "config": {"recipe_config": args.config, "overrides": args.set, "mus": args.mus, "reps": args.reps,
                   "world_size": world, "prompts": n_prompts, "per_rank_completions_per_rollout": cfg.completions_per_rollout,
                   "recipe": {k: v for k, v in cfg.to_dict().items() if k not in ("output_dir",)},
                   "trl_grpo_config_mu1": trl_fields(cfg, 1, steps_for(args.steps, cfg.optimizer_steps_per_pass), cuda)},
        "deepspeed": {"trl_zero": args.trl_zero, "ours_resolved": ours_ds, "trl_resolved": trl_ds, "differences": ds_differences(ours_ds, trl_ds)},
        "verification": {"all_ok": all(v["ok"] for v in expect.values()), "runs": expect},
        "fairness": FAIRNESS,
        "commands": {"benchmark": "python bench/vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "env": "OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONPATH=<repo>",
                     "per_mu": {mu: {k: " ".join(v) for k, v in c.items()} for mu, c in cmds.items()}},
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from common import save_json

    name = "vs_trl" if args.trl_zero == "accelerate" else "vs_trl_recipe_zero"
    save_json(f"{name}.json", result, out)
    plot(runs, summary, args.mus, out / f"{name}.png")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"step_time_ratio (ours/TRL) {summary['step_time_ratio']:.3f}; rollout {summary['rollout_time_ratio']:.3f}; "
          f"generate {summary['generate_time_ratio']:.3f}; verification ok: {result['verification']['all_ok']}; "
          f"wrote {out / name}.json and .png")
    print(markdown_table(summary))
    return 0 if result["verification"]["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
