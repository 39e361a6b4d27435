"""The floor for bench/vs_trl_real.py: the same GRPO work in plain PyTorch, one process per rank, no framework.

    python -m torch.distributed.run --nproc_per_node 2 bench/floor_runner.py SPEC.json

Each rank holds the whole model (fp32, no ZeRO), samples with the model's own `generate` (the same prompts
through the chat template, the same sampling settings and group size), scores with the recipe's reward code
(as the TRL side does), then trains on exactly the generated tokens without padding: one forward and backward
per sequence, the clipped token-mean loss over the optimizer step's tokens against old log-probs captured in the
first pass, gradients summed over the ranks once per optimizer step (in buckets of 64 MiB, as DDP does: no copy of
the whole model's gradients), torch's fused AdamW (as the recipe's on CPU), activations checkpointed where the run
asks (`gradient_checkpointing`, enabled as the recipe enables it). What is left is the arithmetic a GRPO step needs
plus the gradients' all-reduce: any framework's time above it is overhead.

SPEC.json (written by vs_trl_real.py): model, prompts_file (chat messages as TRL's), reward_funcs, output_dir and
`run` (num_generations, prompts_per_rank, max_completion_length, temperature, top_p, top_k, num_iterations,
step_sequences (a rank's per optimizer step), max_steps, learning_rate, adam betas/eps/weight_decay, epsilon,
epsilon_high, seed, gradient_checkpointing). Events go to OUT/events-rankR.jsonl in bench/trl_runner.py's format
(train_begin, generate, prepare, forward, backward, rewards, step_end) so that vs_trl_logs.read_trl reads all three
sides alike; OUT/log_history.json holds each step's completion tokens.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUCKET = 1 << 24  # gradient elements per all-reduce (64 MiB of fp32)
sys.path.insert(0, str(REPO))  # the recipe's own reward functions, as on the TRL side


def main(spec_path: str) -> int:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_recipe.rewards.funcs import load_reward_funcs

    spec = json.loads(Path(spec_path).read_text())
    run, out = spec["run"], Path(spec["output_dir"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out.mkdir(parents=True, exist_ok=True)
    events = (out / f"events-rank{rank}.jsonl").open("w")

    def emit(kind: str, **fields) -> None:
        events.write(json.dumps({"event": kind, "t": time.perf_counter(), **fields}) + "\n")
        events.flush()

    torch.manual_seed(run["seed"] + rank)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.config.use_cache = True
    if run.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()  # as grpo_recipe/model/load.py; generation (eval mode) keeps its cache
    opt = torch.optim.AdamW(model.parameters(), lr=run["learning_rate"], betas=tuple(run["adam_betas"]),
                            eps=run["adam_epsilon"], weight_decay=run["weight_decay"], fused=True)
    funcs = load_reward_funcs(spec["reward_funcs"])
    rows = [json.loads(line) for line in Path(spec["prompts_file"]).read_text().splitlines()]
    mine = rows[rank::world]
    G, per_rank, mu, mb = run["num_generations"], run["prompts_per_rank"], run["num_iterations"], run["step_sequences"]
    steps_per_pass = per_rank * G // mb
    history, step, rollout = [], 0, 0
    emit("train_begin")
    while step < run["max_steps"]:
        t_prep = time.perf_counter()
        batch = [mine[(rollout * per_rank + i) % len(mine)] for i in range(per_rank)]
        prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in batch]
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=run["temperature"], top_p=run["top_p"],
                                 top_k=run["top_k"], max_new_tokens=run["max_completion_length"],
                                 num_return_sequences=G, pad_token_id=tok.pad_token_id)
        emit("generate", seconds=time.perf_counter() - t0)
        samples = []  # (prompt ids, completion ids) without any padding; a completion ends at its EOS
        for i, row in enumerate(gen):
            p_ids = enc["input_ids"][i // G][enc["attention_mask"][i // G].bool()].tolist()
            c_ids = row[enc["input_ids"].shape[1]:].tolist()
            if tok.eos_token_id in c_ids:
                c_ids = c_ids[:c_ids.index(tok.eos_token_id) + 1]
            samples.append((p_ids, c_ids or [tok.eos_token_id]))
        texts = [tok.decode(c, skip_special_tokens=True) for _, c in samples]
        rewards = torch.zeros(len(samples))
        for f in funcs:
            values = f.fn(prompts=[p for p in prompts for _ in range(G)], completions=texts, **f.kwargs)
            emit("rewards", func=f.name, weight=f.weight, n=len(values), mean=sum(values) / len(values))
            rewards += f.weight * torch.tensor([float(v) for v in values])
        groups = rewards.view(-1, G)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        emit("prepare", seconds=time.perf_counter() - t_prep)
        model.train()
        old: dict[int, torch.Tensor] = {}
        g = torch.Generator().manual_seed(run["seed"] * 1000 + rollout)
        for p in range(mu):
            order = torch.randperm(len(samples), generator=g).tolist()
            for s in range(steps_per_pass):
                idx = order[s * mb:(s + 1) * mb]
                tokens = torch.tensor(float(sum(len(samples[i][1]) for i in idx)))
                dist.all_reduce(tokens)  # the step's completion tokens over all ranks: DAPO's normalizer
                for i in idx:
                    t0 = time.perf_counter()
                    p_ids, c_ids = samples[i]
                    ids = torch.tensor([p_ids + c_ids])
                    logits = model(input_ids=ids).logits[0, len(p_ids) - 1:-1].float() / run["temperature"]
                    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c_ids).unsqueeze(-1)).squeeze(-1)
                    ref = old.setdefault(i, logp.detach())
                    ratio = torch.exp(logp - ref)
                    clipped = ratio.clamp(1 - run["epsilon"], 1 + run["epsilon_high"])
                    loss = -torch.min(ratio * adv[i], clipped * adv[i]).sum() / tokens * world
                    emit("forward", seconds=time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    loss.backward()
                    emit("backward", seconds=time.perf_counter() - t0)
                t0 = time.perf_counter()
                _all_reduce_mean([q.grad for q in model.parameters() if q.grad is not None], world)
                opt.step()
                opt.zero_grad(set_to_none=False)
                emit("backward", seconds=time.perf_counter() - t0)
                step += 1
                history.append({"step": step, "train_tokens": int(tokens.item())})
                emit("step_end", step=step)
                if step >= run["max_steps"]:
                    break
            if step >= run["max_steps"]:
                break
        rollout += 1
    if rank == 0:
        (out / "log_history.json").write_text(json.dumps(history))
    events.close()
    dist.destroy_process_group()
    return 0


def _all_reduce_mean(grads: list, world: int) -> None:
    """Average the gradients over the ranks in place, a bucket of up to BUCKET elements per all-reduce (a larger
    gradient alone, without a copy)."""
    import torch
    import torch.distributed as dist

    def flush(bucket: list) -> None:
        if len(bucket) == 1:
            dist.all_reduce(bucket[0])
            bucket[0].div_(world)
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= world
        start = 0
        for g in bucket:
            g.copy_(flat[start:start + g.numel()].view_as(g))
            start += g.numel()

    bucket, size = [], 0
    for g in grads:
        if bucket and size + g.numel() > BUCKET:
            flush(bucket)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        flush(bucket)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
