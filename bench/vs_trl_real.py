"""Speed and memory on real model shapes: this recipe, TRL 1.16's GRPOTrainer and the floor, side by side.

    python bench/vs_trl_real.py                       # both shapes, mu 1 and 4, 2 repetitions -> vs_trl_real.{json,png}
    python bench/vs_trl_real.py --shapes smollm2      # one shape (the other keeps its figures in the file)
    # finished runs are kept in the results file: a later invocation continues where one stopped (--fresh: anew)
    python bench/vs_trl_real.py --smoke --out DIR     # CI: every side and the summary in minutes, no claim
    python bench/vs_trl_real.py --pilot --shapes qwen05b --mus 1   # first: fits? hours? -> vs_trl_real_pilot.json

The design, declared before the runs:
- Shapes: SmolLM2-135M-Instruct (real weights, 49k vocabulary; grpo_recipe.tools.prepare_model --source smollm2)
  and a Qwen2.5-0.5B-shaped model (random weights, 151k vocabulary, bench/measure.py) with SmolLM2's tokenizer
  and chat template (a random model rarely ends at EOS: its completions run to the cap).
- The same work on every side: 2 CPU ranks, GSM8K-shaped questions (grpo_recipe/assets) through the model's chat
  template, 8 completions per prompt, 1 prompt per rank per rollout, completions up to 256 tokens ending at EOS,
  transformers' generate, one optimizer step per pass, mu = 1 and 4, at least 20 optimizer steps after the first
  rollout (warm-up, not timed), 2 repetitions, the sides alternating (ours, TRL, floor, ours, ...) so that load
  drift hits all. A repetition's three sides run on one machine instance (boot): a later invocation on another
  measures a half-finished repetition anew, and the summary marks a finished one whose sides do not share one.
  ZeRO-3 on the recipe and TRL (bench/vs_trl.py's fairness rules, which the JSON repeats).
- The 0.5B shape checkpoints activations on every side (`gradient_checkpointing`: the recipe's and TRL's option,
  the floor's model enabled as the recipe enables it) and accumulates an optimizer step's 8 sequences per rank over
  2 micro-batches of 4: as first piloted (micro-batches of 8), TRL's ranks came within 1 GiB of the memory this
  24 GiB machine had free (reaching 20.8 GiB), with checkpointing (on its second step of two) and without (on its
  first). Under glibc's defaults they still did (reaching 20.9 GiB, on the second step, still growing), so at this
  shape TRL runs under the recipe's allocator settings (grpo_recipe/dist/allocator.py, as environment;
  `recipe_allocator` in the JSON): the step time it is compared at is then its code's, not its allocator's.
- A learning rate too small to move the policy (1e-30: every optimizer step still runs), so all sides sample from
  the same fixed policy and see one distribution of prompt and completion lengths.
- The floor (bench/floor_runner.py): plain PyTorch, one process per rank, the whole model on each rank, the same
  generation, then forward and backward on exactly the generated tokens without padding.
- Measured: seconds per optimizer step (each run's own per-step clock), per phase (generation; the rest of the
  rollout's preparation: rewards, old and reference log-probs, weight sync; forward + loss; backward + optimizer;
  other), completion tokens trained per second, and the peak private memory (RssAnon) of each rank process,
  sampled alike for all sides (bench/measure.py whole_run_peaks). A timed run needs the machine alone: the load
  is recorded at each run's start and end.
- Piloted per shape before its runs (--pilot: the design's sizes, one repetition, two rollouts a side): whether
  each side fits in memory (a side whose ranks together come within 1 GiB of the memory the machine had free at its
  start is stopped there; a study's run is not, and may finish that close, as TRL does at SmolLM2's shape), and
  the study's hours projected from the pilot's phases.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

SIDES = ("ours", "trl", "floor")
SHAPES = ("smollm2", "qwen05b")
RUN = {"max_completion_length": 256, "max_prompt_length": 256, "num_generations": 8,
       "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "optimizer_steps_per_pass": 1,
       "learning_rate": 1e-30, "temperature": 1.0, "beta": 0.0, "loss_type": "dapo",
       "logging_steps": 1, "save_steps": 0, "disable_tqdm": True, "reward_funcs": ["length"],
       "prompt_column": "prompt", "max_grad_norm": 1.0}
# on top of RUN, every side (the design says why)
SHAPE_RUN = {"qwen05b": {"gradient_checkpointing": True, "per_device_train_batch_size": 4,
                         "gradient_accumulation_steps": 2}}
# sides that run under the recipe's allocator settings (as environment) at a shape: the design says why
RECIPE_ALLOCATOR = {"qwen05b": ("trl",)}
TIMED_STEPS = 20
PILOT_FILE = "vs_trl_real_pilot.json"
HEADROOM = 1 << 30  # a pilot's side fits when its ranks leave this much of the memory free at its start
MUS, REPS = (1, 4), 2  # the declared design: `complete` and `runs_to_go` count it whatever one invocation measures
SMOKE = {"run": {"max_completion_length": 8, "num_generations": 2, "per_device_train_batch_size": 4},
         "steps": 2, "mus": [1], "reps": 1, "shapes": ["smollm2"]}
STEP_TIME_GOALS = {"smollm2": 0.75, "qwen05b": 0.85}  # ours / TRL seconds per optimizer step, at most
GOALS = {"step_time": "ours / TRL seconds per optimizer step <= {smollm2} on smollm2 and <= {qwen05b} on qwen05b, "
                      "mu 1 and 4".format(**STEP_TIME_GOALS),
         "floor": "ours / floor seconds per optimizer step <= 1.25 on both shapes",
         "memory": "ours / TRL peak private memory per rank (worst rank) <= 1.0 on both shapes"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--mus", type=int, nargs="+", default=list(MUS), help="measure only these now (the design: "
                                                                      "1 and 4; e.g. the shorter mu = 4 runs first)")
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one short run per side (CI)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--workdir", default=None, help="run folders (default output/vs_trl_real, or _smoke)")
    p.add_argument("--fresh", action="store_true", help="measure the shapes and --mus asked again, every side, "
                                                        "instead of keeping their finished runs (after a change)")
    p.add_argument("--reread", action="store_true", help="measure nothing: read each kept run's figures again "
                                                          "from its logs in the work folder (after a fix to a reader)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds before one run is killed")
    p.add_argument("--pilot", action="store_true", help=f"the design's sizes, one repetition, two rollouts a side "
                                                         f"(one timed), to {PILOT_FILE}: whether each side fits in "
                                                         f"memory and the study's hours (projected)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                   help="with --pilot: pilot only these (the file keeps the other sides' last pilot)")
    return p.parse_args(argv)


def kept_runs(runs: list[dict], shapes, mus, fresh: bool, here: str) -> list[dict]:
    """The finished runs a new invocation keeps: all but those of the shapes and mus asked with `fresh`, and but
    those of an unfinished repetition measured on another machine instance than `here` (its sides must share one)."""
    sides = {}
    for r in runs:
        sides.setdefault((r["shape"], r["mu"], r["rep"]), []).append(r)
    return [r for r in runs if not (fresh and r["shape"] in shapes and r["mu"] in mus)
            and (len(sides[r["shape"], r["mu"], r["rep"]]) == len(SIDES) or r.get("instance") == here)]


def recipe_allocator_env() -> dict:
    """The allocator settings a recipe rank runs under on CPU (grpo_recipe/dist/allocator.py), as environment."""
    from grpo_recipe.dist import allocator

    return {"MALLOC_MMAP_THRESHOLD_": str(allocator.MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD), "GLIBC_TUNABLES": allocator.HUGE_PAGES}


def shape_folder(shape: str, work: Path) -> Path:
    """The model folder of `shape`, with SmolLM2's tokenizer and chat template."""
    from real_vs_trl import prepare_model

    smollm2 = prepare_model()
    if shape == "smollm2":
        return smollm2
    from measure import QWEN05B, build_model

    from grpo_recipe.model.tiny import cache_root

    weights = build_model(QWEN05B, cache_root() / "bench-qwen05b-shape")
    folder = work / "qwen05b"
    folder.mkdir(parents=True, exist_ok=True)
    for src in [*weights.iterdir(), *smollm2.glob("tokenizer*"), *smollm2.glob("chat_template*")]:
        dst = folder / src.name
        if not dst.exists() and src.is_file() and (src.name.startswith(("tokenizer", "chat_template"))
                                                   or src.parent == weights):
            dst.symlink_to(src)
    return folder


def recipe_argv(model: Path, prompts: Path, run: dict, mu: int, steps: int, out: Path) -> list[str]:
    argv = ["--config", "grpo_recipe/configs/quickstart.yaml", "--model_name_or_path", str(model),
            "--dataset_name", str(prompts), "--num_iterations", str(mu), "--max_steps", str(steps),
            "--output_dir", str(out), "--overwrite_output_dir", "true"]
    for k, v in run.items():
        argv += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    return argv


def write_prompts(model: Path, run: dict, work: Path) -> tuple[Path, Path]:
    """The recipe's prompt file (question text, formatted by the recipe with the chat template) and TRL's (the
    same as chat messages; real_vs_trl.chat_prompts checks both sides render the same text)."""
    import datasets
    from real_vs_trl import chat_prompts

    from grpo_recipe.config.load import load_config
    from grpo_recipe.model.load import load_tokenizer

    rows = datasets.load_dataset("parquet", data_files=str(REPO / "grpo_recipe/assets/gsm8k_like.parquet"),
                                 split="train")
    work.mkdir(parents=True, exist_ok=True)
    ours, trl = work / "prompts.jsonl", work / "trl_prompts.jsonl"
    with ours.open("w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["question"], "answer": r["answer"]}) + "\n")
    cfg = load_config(recipe_argv(model, ours, run, 1, 2, work / "unused"), world_size=2)
    chat_prompts(cfg, load_tokenizer(str(model)), trl)
    return ours, trl


def side_command(side: str, model: Path, prompts: dict, run: dict, mu: int, steps: int, run_dir: Path,
                 ds_file: Path) -> list[str]:
    from vs_trl import trl_fields

    from grpo_recipe.config.load import load_config
    from grpo_recipe.dist.env import torchrun

    if side == "ours":
        return torchrun(2, ["-m", "grpo_recipe.train", *recipe_argv(model, prompts["ours"], run, mu, steps,
                                                                    run_dir / "ours")])
    cfg = load_config(recipe_argv(model, prompts["ours"], run, mu, steps, run_dir / "ours"), world_size=2)
    spec = run_dir / f"{side}_spec.json"
    if side == "trl":
        spec.write_text(json.dumps({"output_dir": str(run_dir / "trl"), "model": str(model),
                                    "prompts_file": str(prompts["trl"]), "deepspeed_config": str(ds_file),
                                    "reward_funcs": cfg.reward_funcs, "chat_prompts": True,
                                    "grpo_config": trl_fields(cfg, mu, steps, False)}, indent=1))
        return torchrun(2, [str(REPO / "bench" / "trl_runner.py"), str(spec)])
    spec.write_text(json.dumps({"output_dir": str(run_dir / "floor"), "model": str(model),
                                "prompts_file": str(prompts["trl"]), "reward_funcs": cfg.reward_funcs,
                                "run": {"num_generations": cfg.num_generations,
                                        "prompts_per_rank": cfg.completions_per_rollout // cfg.num_generations,
                                        "step_sequences": cfg.per_device_train_batch_size
                                        * cfg.gradient_accumulation_steps,
                                        "max_completion_length": cfg.max_completion_length,
                                        "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                                        "num_iterations": mu, "max_steps": steps,
                                        "learning_rate": cfg.learning_rate,
                                        "adam_betas": [cfg.adam_beta1, cfg.adam_beta2],
                                        "adam_epsilon": cfg.adam_epsilon, "weight_decay": cfg.weight_decay,
                                        "epsilon": cfg.epsilon, "epsilon_high": cfg.eps_high,
                                        "seed": cfg.seed, "gradient_checkpointing": cfg.gradient_checkpointing}},
                                indent=1))
    return torchrun(2, [str(REPO / "bench" / "floor_runner.py"), str(spec)])


def read_side(side: str, run_dir: Path, spr: int, completions_per_step: int) -> dict:
    """Step ends, per-phase seconds per step and completion tokens trained per step, from the side's own logs."""
    from vs_trl_logs import read_ours, read_trl, summarize_run

    if side == "ours":
        parsed = read_ours(run_dir / "ours", spr)
        recs = [json.loads(x) for x in (run_dir / "ours" / "metrics.jsonl").read_text().splitlines()]
        tokens = [r["train_tokens"] for r in recs[spr:]]
    else:
        parsed = read_trl(run_dir / side, spr, 2)
        history = json.loads((run_dir / side / "log_history.json").read_text())
        if side == "floor":
            tokens = [h["train_tokens"] for h in history][spr:]
        else:  # TRL logs each step's mean completion length over the generation that step trains on
            lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
            tokens = [x * completions_per_step for x in lengths[spr:]]
    run = summarize_run(parsed, spr)
    return {**run, "train_tokens_per_step": statistics.fmean(tokens) if tokens else None,
            "tokens_per_s": statistics.fmean(tokens) / run["sec_per_step"] if tokens else None,
            "optimizer_steps": parsed["optimizer_steps"]}


def summarize(runs: list[dict], shape: str) -> dict | None:
    """Per mu: each side's median seconds per step and phases, the paired ratios (same repetition), memory.
    Only repetitions that every side has finished count; None while no mu has one."""
    out = {"by_mu": {}, "step_time_ratio": {}, "floor_ratio": {}}
    mine = [r for r in runs if r["shape"] == shape]
    for mu in sorted({r["mu"] for r in mine}):
        by = {(r["side"], r["rep"]): r for r in mine if r["mu"] == mu}
        reps = sorted(i for i in {r for _, r in by} if all((side, i) in by for side in SIDES))
        if not reps:
            continue
        entry = {side: {"sec_per_step": statistics.median(by[side, i]["sec_per_step"] for i in reps),
                        "tokens_per_s": statistics.median(by[side, i]["tokens_per_s"] or 0.0 for i in reps),
                        "phases_s_per_step": {k: statistics.median(by[side, i]["phases_s_per_step"][k] for i in reps)
                                              for k in by[side, reps[0]]["phases_s_per_step"]},
                        "peak_rss_bytes": max(max(by[side, i]["peak_bytes"]) for i in reps)} for side in SIDES}
        pair = lambda a, b: statistics.median(by[a, i]["sec_per_step"] / by[b, i]["sec_per_step"] for i in reps)  # noqa: E731
        entry["ours_over_trl"], entry["ours_over_floor"] = pair("ours", "trl"), pair("ours", "floor")
        entry["reps"] = reps
        # the ratios pair sides run back to back on one instance; runs from before the stamp count as unknown
        entry["sides_on_one_instance"] = all(len({by[side, i].get("instance") for side in SIDES}) == 1
                                             and by["ours", i].get("instance") for i in reps)
        out["by_mu"][str(mu)] = entry
        out["step_time_ratio"][f"mu{mu}"] = entry["ours_over_trl"]
        out["floor_ratio"][f"mu{mu}"] = entry["ours_over_floor"]
    if not out["by_mu"]:
        return None
    peaks = {side: max(max(r["peak_bytes"]) for r in mine if r["side"] == side) for side in SIDES}
    out["peak_rss_ratio"] = peaks["ours"] / peaks["trl"]
    out["peak_rss_bytes"] = peaks
    out["model"] = mine[0]["model"]
    return out


def summaries(runs: list[dict]) -> dict:
    """Each shape's summary (`summarize`), for the shapes with a finished (ours, TRL, floor) set."""
    return {shape: s for shape in dict.fromkeys(r["shape"] for r in runs) if (s := summarize(runs, shape)) is not None}


def save(result: dict, out: Path, planned: list[tuple], t0: float) -> None:
    """The results file as it stands, after every run: a later invocation continues from it."""
    from common import save_json

    result["this_invocation_wall_s"] = time.perf_counter() - t0
    result["machine"]["load_average_at_end"] = os.getloadavg()
    done = {(r["shape"], r["side"], r["mu"], r["rep"]) for r in result["runs"]}
    result["shapes"] = summaries(result["runs"])
    result["complete"] = all(k in done for k in planned)
    result["runs_to_go"] = [list(k) for k in planned if k not in done]
    save_json("vs_trl_real.json", result, out)
    if result["shapes"]:
        plot(result, out / "vs_trl_real.png")


def project(runs: list[dict]) -> dict:
    """A model from the pilot's runs, labelled as one: per shape and side, the seconds a run of the design would
    take at each of MUS (start-up as piloted, then the design's steps, each a 1/mu share of a rollout's
    preparation plus a step's forward, backward and other, all from the pilot's phases at the smallest mu
    piloted); per shape, a repetition's hours at each mu and the whole study's."""
    from vs_trl import steps_for

    out = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        sides = {}
        for side in SIDES:
            done = sorted((r for r in runs if (r["shape"], r["side"]) == (shape, side) and r["exit_code"] == 0),
                          key=lambda r: r["mu"])
            if not done:
                continue
            r, ph = done[0], done[0]["phases_s_per_step"]
            rollout, step = ph["prepare"] * r["mu"], ph["forward"] + ph["backward"] + ph["other"]
            start = r["wall_s"] - r["train_span_s"]
            sides[side] = {str(mu): start + steps_for(TIMED_STEPS + mu, mu) * (rollout / mu + step) for mu in MUS}
        entry = {"run_s": sides}
        if len(sides) == len(SIDES):
            entry["repetition_h"] = {str(mu): sum(s[str(mu)] for s in sides.values()) / 3600 for mu in MUS}
            entry["study_h"] = REPS * sum(entry["repetition_h"].values())
        out[shape] = entry
    return out


def save_pilot(result: dict, out: Path, t0: float) -> None:
    """The pilot's file: each side's exit, whether it was stopped (memory, time), its peaks and phases, and the
    projection (`project`)."""
    from common import save_json

    result["this_invocation_wall_s"] = time.perf_counter() - t0
    result["machine"]["load_average_at_end"] = os.getloadavg()
    result["projection"] = project(result["runs"])
    save_json(PILOT_FILE, result, out)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(result["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    colors = {"generate": "tab:blue", "prepare_rest": "tab:cyan", "forward": "tab:orange", "backward": "tab:red",
              "other": "tab:gray"}
    for ax, shape in zip(axes[0], shapes):
        labels, x = [], 0
        for mu, entry in result["shapes"][shape]["by_mu"].items():
            for side in SIDES:
                ph = entry[side]["phases_s_per_step"]
                parts = {"generate": ph["generate"], "prepare_rest": ph["prepare"] - ph["generate"],
                         "forward": ph["forward"], "backward": ph["backward"], "other": ph["other"]}
                bottom = 0.0
                for k, v in parts.items():
                    ax.bar(x, v, bottom=bottom, color=colors[k], label=k if x == 0 else None)
                    bottom += v
                labels.append(f"{side}\nmu {mu}")
                x += 1
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("seconds per optimizer step")
        ax.set_title(shape)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sides != list(SIDES) and not args.pilot:
        sys.exit("vs_trl_real: --sides is for --pilot only: a study's repetition runs every side, alternating")
    args.out = str(Path(args.out).resolve())
    os.chdir(REPO)
    from common import CODE_AT_START, instance, machine
    from measure import available_memory, whole_run_peaks
    from transformers import AutoConfig
    from vs_trl import FAIRNESS, run_env, steps_for, trl_ds_config, trl_version, versions

    from grpo_recipe.config.load import load_config
    from grpo_recipe.model import engine as eng

    version = trl_version(sys.executable)
    run = dict(RUN, **(SMOKE["run"] if args.smoke else {}))
    shapes, mus, reps = (SMOKE["shapes"], SMOKE["mus"], SMOKE["reps"]) if args.smoke else (args.shapes, args.mus,
                                                                                             args.reps)
    if args.pilot:
        reps = 1
    timed = SMOKE["steps"] if args.smoke else TIMED_STEPS
    work = Path(args.workdir or REPO / "output" / ("vs_trl_real" + ("_smoke" if args.smoke else "")
                                                   + ("_pilot" if args.pilot else "")))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    name = PILOT_FILE if args.pilot else "vs_trl_real.json"
    previous = json.loads((out / name).read_text()) if (out / name).is_file() else {}
    # finished runs are kept while the design is the same: the study spans sessions (hours per shape on 2 cores)
    same = (previous.get("run"), previous.get("timed_steps"), previous.get("smoke")) == (run, timed, args.smoke)
    here, started = instance(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # and a shape's runs while its own settings are (SHAPE_RUN, RECIPE_ALLOCATOR)
    now = {"shape_run": SHAPE_RUN, "recipe_allocator": {k: list(v) for k, v in RECIPE_ALLOCATOR.items()}}
    alike = [r for r in previous.get("runs", []) if all(previous.get(k, {}).get(r["shape"], {}) == v.get(r["shape"], {})
                                                        for k, v in now.items())]
    if args.pilot:  # a pilot measures anew what it is asked, and keeps the last pilot of the rest
        kept = [r for r in (alike if previous.get("run") == run else [])
                if not (r["shape"] in shapes and r["mu"] in mus and r["side"] in args.sides)]
    else:
        kept = kept_runs(alike if same else [], shapes, mus, args.fresh, here)
    planned = [(shape, side, mu, rep) for shape in (shapes if args.smoke else SHAPES)
               for rep in range(reps if args.smoke else REPS) for mu in (mus if args.smoke else MUS) for side in SIDES]
    result = {"benchmark": "vs_trl_real", "goals": GOALS, "design": __doc__.split("The design, declared before the "
                                                                               "runs:")[1].strip(),
              "fairness": FAIRNESS, "trl_version": version, "versions": versions(sys.executable), "run": run,
              **now,
              "timed_steps": "one rollout" if args.pilot else timed, "smoke": args.smoke, "runs": kept,
              "machine": machine(load_average_at_start=os.getloadavg()),
              "commands": {"benchmark": "python bench/vs_trl_real.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])}}
    done = {(r["shape"], r["side"], r["mu"], r["rep"]) for r in kept}
    env, t0 = run_env(), time.perf_counter()
    for shape in shapes:
        model, shape_run = shape_folder(shape, work), {**run, **SHAPE_RUN.get(shape, {})}
        prompts = dict(zip(("ours", "trl"), write_prompts(model, shape_run, work / shape)))
        cfg = load_config(recipe_argv(model, prompts["ours"], shape_run, 1, 2, work / "unused"), world_size=2)
        ds_file = work / shape / "ds_config_trl.json"
        ds_file.write_text(json.dumps(trl_ds_config(cfg, False, eng.ds_config(
            cfg, 2, AutoConfig.from_pretrained(model).hidden_size)), indent=1))
        for rep in range(reps):
            for mu in mus:
                spr = mu * cfg.optimizer_steps_per_pass
                steps = steps_for((spr if args.pilot else timed) + spr, spr)
                # completions each optimizer step trains on (both ranks): a pass is the whole rollout
                per_step = cfg.completions_per_rollout * 2 // cfg.optimizer_steps_per_pass
                for side in args.sides:
                    run_dir = work / shape / f"mu{mu}-rep{rep}"
                    if (shape, side, mu, rep) in done:
                        if args.reread and (run_dir / side).is_dir():  # the kept run's figures from its own logs
                            record = next(r for r in result["runs"] if (r["shape"], r["side"], r["mu"], r["rep"])
                                          == (shape, side, mu, rep))
                            record.update(read_side(side, run_dir, spr, per_step),
                                          reread_at=CODE_AT_START.get("commit"))
                        continue
                    if args.reread:
                        continue
                    shutil.rmtree(run_dir / side, ignore_errors=True)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    cmd = side_command(side, model, prompts, shape_run, mu, steps, run_dir, ds_file)
                    print(f"vs_trl_real: {shape} rep {rep} mu {mu} {side} ({steps} steps)", file=sys.stderr,
                          flush=True)
                    load = os.getloadavg()[0]
                    limit = available_memory() - HEADROOM
                    side_env = {**env, **(recipe_allocator_env() if side in RECIPE_ALLOCATOR.get(shape, ())
                                          else {})}
                    peaks = whole_run_peaks(cmd, side_env, REPO, log=run_dir / f"{side}.log",
                                            timeout_s=args.timeout, memory_limit=limit if args.pilot else None)
                    why = {"memory": f"its ranks reached {limit / 2**30:.1f} GiB, 1 GiB short of the memory free",
                           "timeout": f"it ran past --timeout {args.timeout:g} s"}.get(peaks["stopped"])
                    if peaks["exit_code"] != 0 and args.pilot:
                        print(f"vs_trl_real: pilot {shape} {side} mu {mu}: "
                              f"{why or 'exit ' + str(peaks['exit_code'])}", file=sys.stderr, flush=True)
                        result["runs"].append({"shape": shape, "side": side, "mu": mu, "rep": rep, "max_steps": steps,
                                               "commit": CODE_AT_START.get("commit"), "instance": here,
                                               "memory_limit": limit, **peaks})
                        save_pilot(result, out, t0)
                        continue
                    if peaks["exit_code"] != 0:
                        tail = "\n".join((run_dir / f"{side}.log").read_text(errors="replace").splitlines()[-25:])
                        sys.exit(f"vs_trl_real: {shape} {side} mu {mu} failed ({why or peaks['exit_code']}):\n{tail}")
                    parsed = read_side(side, run_dir, spr, per_step)
                    result["runs"].append({"shape": shape, "model": model.name, "side": side, "mu": mu, "rep": rep,
                                           "max_steps": steps, "load_1m": [load, os.getloadavg()[0]],
                                           "commit": CODE_AT_START.get("commit"), "instance": here,
                                           "invocation": started,
                                           "wall_s": peaks["wall_s"], "peak_bytes": peaks["peak_bytes"],
                                           "exit_code": 0, **parsed})
                    if args.pilot:
                        save_pilot(result, out, t0)
                    else:
                        save(result, out, planned, t0)
    if args.pilot:
        save_pilot(result, out, t0)
        print(json.dumps(result["projection"], indent=1))
        return 0
    save(result, out, planned, t0)
    for shape, s in result["shapes"].items():
        print(f"{shape}: ours/TRL {s['step_time_ratio']}, ours/floor {s['floor_ratio']}, "
              f"peak memory ours/TRL {s['peak_rss_ratio']:.2f}")
    print(f"vs_trl_real: {len(result['runs_to_go'])} runs to go" if result["runs_to_go"] else "vs_trl_real: complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
