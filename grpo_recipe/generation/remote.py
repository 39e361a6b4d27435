"""Generation on its own ranks (`generation_ranks: N`, dist/link.py): the trainers' side, `RemoteGenerator`, and
the generation ranks' program, `serve`.

Trainer 0 drives: it tells the generators which rollout to generate and sends them the policy's weights (gathered
from the ZeRO-3 shards chunk by chunk on every trainer, broadcast in buckets). Each generator builds the prompts
of the trainers it serves from the same data and seeds as they do (no prompt is sent to it; they come back with
the completions, as a check), samples on its own whole copy of the policy (transformers' `generate`, or a vLLM
engine of its own with `generation_backend: vllm`), and sends each trainer its completions with the sampler's
log-probs. The lag is the only difference from generating in place:
- `max_staleness: 0`: rollout k is asked for when it is needed, after the weights of rollout k were sent: the
  same samples as the colocated layout (same weights, prompts and seeds), while the generators idle in training;
- `max_staleness: 1`: rollout k + 1 is asked for as soon as rollout k arrives, so it is sampled from the weights
  one sync older while rollout k trains. The loss corrects the lag with the sampler's log-probs
  (`vllm_importance_sampling_*`, the same weights as for vLLM's drift).
A rollout received ahead of its turn is part of the checkpoint (`state_dict`), so a resumed run trains on the
very samples the interrupted one would have. Evaluation runs on the trainers, on the engine's own weights.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator

import torch

from grpo_recipe.dist import liveness, link
from grpo_recipe.generation.base import Completions, rollout_seed
from grpo_recipe.generation.hf import HFGenerator
from grpo_recipe.generation.tools import (ToolRunner, context_length, load_tools, multi_turn, round_seed,
                                          set_templates)
from grpo_recipe.generation.vllm_lora import gathered_weights, needs_untied

BUCKET_NUMEL = 1 << 26  # parameters gathered (and broadcast) at once during a sync (256 MiB in fp32)


class RemoteGenerator:
    """The trainers' side of `generation_ranks`: rollouts from the generation ranks, evaluation here."""

    def __init__(self, cfg, engine, tokenizer):
        self.cfg, self.engine, self.tok = cfg, engine, tokenizer
        self.link = link.current()
        self.rank = self.link.lay.rank
        self.src = self.link.lay.generator_of(self.rank)
        self.local = HFGenerator(cfg, engine, tokenizer)  # evaluation: greedy or n samples, on the trainers
        self.syncs, self.stats = 0, {}
        self.synced_step: int | None = None  # engine.global_steps of the weights the generators hold
        self.requested: int | None = None  # the rollout asked for and not received yet
        self.ready: dict | None = None  # a rollout received ahead of its turn (kept by checkpoints)

    # --- rollouts --------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], seed: int, n: int | None = None,
                 greedy: bool = False, rollout: int | None = None) -> Completions:
        if rollout is None or greedy or n is not None:
            return self.local.generate(prompt_ids, seed, n=n, greedy=greedy)
        if self.synced_step is None:  # the generators never sample from weights the trainers did not send
            self.sync(self.engine)
        if self.ready is not None and self.ready["rollout"] != rollout:
            # a stop while rollout `rollout` was being scored: it is generated again, and its successor after it
            self.ready = None
        if self.ready is not None:
            got, self.ready = self.ready, None
        else:
            if self.requested != rollout:
                self._request(rollout)
            got = self._receive()
        if got["rollout"] != rollout or got["prompt_ids"] != [list(p) for p in prompt_ids]:
            raise RuntimeError(f"generation rank {self.src} sent rollout {got['rollout']} with other prompts than "
                               f"this rank's rollout {rollout}: the two sides read different data")
        if self.cfg.max_staleness:  # sampled while this one trains, from the weights it was sampled after
            self._request(rollout + 1)
        self.stats = {"staleness_steps": self.engine.global_steps - got["weights_step"],
                      "generator_busy_s": got["busy_s"], "generator_waited_s": got["waited_s"]}
        return completions(got, self.tok)

    def _request(self, rollout: int) -> None:
        if self.rank == 0:
            self.link.broadcast_json({"cmd": "generate", "rollout": rollout})
        self.requested = rollout

    def _receive(self) -> dict:
        message, (logps,) = self.link.recv(self.src)
        self.requested = None
        if "error" in message:
            raise RuntimeError(f"generation rank {self.src}: {message['error']}")
        return message | {"logps": logps}

    # --- weights ---------------------------------------------------------------------------
    def sync(self, engine) -> None:
        """Send the engine's current weights to the generators (collective over the trainers: each gathers its
        chunks; trainer 0 broadcasts them). A no-op when they already have them."""
        if self.synced_step == engine.global_steps:
            return
        root = self.rank == 0
        if root:
            # untied: a LoRA layer on a tied matrix, whose merged value differs from the embeddings'
            self.link.broadcast_json({"cmd": "weights", "step": engine.global_steps,
                                      "untied": needs_untied(engine.module)})
        bucket: list[tuple[str, torch.Tensor]] = []
        for name, tensor in gathered_weights(engine, BUCKET_NUMEL):
            if not root:
                continue
            if bucket and (tensor.dtype != bucket[0][1].dtype or sum(t.numel() for _, t in bucket) +
                           tensor.numel() > BUCKET_NUMEL):
                self._send_bucket(bucket)
                bucket = []
            bucket.append((name, tensor))
        if root:
            if bucket:
                self._send_bucket(bucket)
            self.link.broadcast_json({"names": []})
        self.syncs += 1
        self.synced_step = engine.global_steps

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.link.broadcast_json({"names": [n for n, _ in bucket], "shapes": [list(t.shape) for _, t in bucket],
                                  "dtype": str(bucket[0][1].dtype).removeprefix("torch.")})
        self.link.broadcast(torch.cat([t.reshape(-1).cpu() for _, t in bucket]))

    # --- checkpoints and the end -----------------------------------------------------------
    def state_dict(self) -> dict | None:
        """A rollout asked for ahead of its turn is received now (the generator is on it) and saved: the
        weights it was sampled from are gone after this rollout's steps."""
        if self.requested is not None:
            self.ready = self._receive()
        return None if self.ready is None else {"ready": self.ready}

    def load_state_dict(self, state: dict | None) -> None:
        self.ready = None if state is None else state["ready"]

    def release(self) -> None:
        pass  # the generation ranks' memory is their own

    def close(self) -> None:
        """Take the rollout still in flight (nobody trains on it), then trainer 0 stops the generators."""
        if self.requested is not None:
            self._receive()
        if self.rank == 0:
            self.link.broadcast_json({"cmd": "stop"})
        self.link.flush()


def completions(got: dict, tokenizer) -> Completions:
    ids = got["ids"]
    width = max(1, max(len(x) for x in ids))
    mask = torch.zeros(len(ids), width)
    for i, x in enumerate(ids):
        mask[i, :len(x)] = 1.0
    tool_mask = None if got.get("tool_mask") is None else torch.tensor(got["tool_mask"])[:, :width]
    return Completions(ids, mask, torch.tensor(got["truncated"], dtype=torch.bool), got["texts"],
                       got["logps"][:, :width], tool_mask, got.get("turns"), got.get("tool_counts"))


# ------------------------------------------------------------------------------------------
# the generation ranks
# ------------------------------------------------------------------------------------------
def serve(cfg, data: tuple | None = None) -> int:
    """A generation rank's program: until trainer 0 says stop, take weights and generate the rollouts it asks
    for, for each trainer this rank serves. Returns the exit code."""
    from grpo_recipe.data.prompts import PromptStream, load_datasets
    from grpo_recipe.dist import signals
    from grpo_recipe.dist.env import PREEMPTED_EXIT_CODE
    from grpo_recipe.model.load import load_model, load_tokenizer
    from grpo_recipe.model.source import model_path

    lay = link.layout(cfg.generation_ranks)
    if torch.cuda.is_available():
        from grpo_recipe.dist.group import own_gpu

        torch.cuda.set_device(own_gpu())
    liveness.set_phase("start-up: loading the model")
    path = model_path(cfg)
    tok = load_tokenizer(path)
    runner = None
    if cfg.tools:  # the tool rounds run here, where the generation runs
        set_templates(tok, cfg)
        runner = ToolRunner(load_tools(cfg.tools), cfg.tool_timeout_s)
    train_prompts, _ = load_datasets(cfg, *(data or ()))
    served = lay.served_by(lay.rank)
    streams = {t: PromptStream(train_prompts, tok, cfg, t, lay.trainers, runner and runner.schemas) for t in served}
    model = gen = None
    if cfg.generation_backend == "hf":
        # the whole policy, plain: the trainers send merged weights (LoRA included) under the model's own names
        model = load_model(path, dataclasses.replace(cfg, use_peft=False, gradient_checkpointing=False))
        model.requires_grad_(False)
        if torch.cuda.is_available():
            model.cuda()
        gen = HFGenerator(cfg, None, tok, model=model, with_logps=True)
    store = link.launch_store(cfg.collective_timeout_s)
    if not link.wait_for_trainers(store, lay, cfg.collective_timeout_s, signals.pending):
        # the trainers stopped during their own start-up (exit 75, nothing written): so does this rank
        print(f"generation rank {lay.rank}: stopped by {signals.pending()} during start-up; exit "
              f"{PREEMPTED_EXIT_CODE}: rerun to start", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    lk = link.connect(lay, cfg.collective_timeout_s, store)
    liveness.start(lay.rank, lay.world, cfg.collective_timeout_s)
    weights_step, waited_since, waited = None, time.perf_counter(), 0.0
    while True:
        liveness.set_phase("waiting for trainer 0")
        message = lk.broadcast_json()
        if message["cmd"] == "stop":
            break
        if message["cmd"] == "weights":
            liveness.set_phase(f"receiving the weights of step {message['step']}")
            weights = received_weights(lk)
            if model is not None:
                if message["untied"]:
                    untie(model)
                load_into(model, weights)
            else:  # vLLM, built at the first weights: whether the head comes untied is known then
                if gen is None:
                    from grpo_recipe.generation.vllm import OwnEngine

                    liveness.set_phase("start-up: building the vLLM engine")
                    gen = OwnEngine(cfg, tok, path, untied=message["untied"])
                gen.load(weights)
            for _ in weights:  # to the end marker, whatever the loader left
                pass
            weights_step = message["step"]
            continue
        rollout = message["rollout"]
        waited += time.perf_counter() - waited_since
        lk.flush()  # the last rollout's completions have reached their trainers (or are about to)
        start, done = time.perf_counter(), {}
        for t in served:  # all of them, then the sends: the trainers go on together anyway
            liveness.set_phase(f"rollout {rollout}: generation for training rank {t}")
            batch = streams[t].batch(rollout)
            seed = rollout_seed(cfg.seed, rollout, t, lay.trainers)
            try:
                if runner is None:
                    done[t] = batch, gen.generate(batch.prompt_ids, seed=seed)
                else:  # the trainers' seeds for each round (train.generate)
                    turn = lambda p, n, k: gen.generate(p, seed=round_seed(seed, k), n=n)  # noqa: E731
                    done[t] = batch, multi_turn(turn, tok, cfg, batch.prompt_ids, runner,
                                                context_length(cfg, model and model.config), synced=False)
            except Exception as e:  # noqa: BLE001 -- the trainer it serves says it, naming this rank
                done[t] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        busy = time.perf_counter() - start
        for t, got in done.items():
            if isinstance(got, str):
                lk.send(t, {"error": got}, [torch.zeros(0)])
                continue
            batch, comp = got
            turns = {} if comp.tool_mask is None else {"tool_mask": comp.tool_mask.tolist(), "turns": comp.turns,
                                                        "tool_counts": comp.tool_counts}
            lk.send(t, {"rollout": rollout, "prompt_ids": batch.prompt_ids, "ids": comp.ids, "texts": comp.texts,
                        "truncated": comp.truncated.tolist(), "weights_step": weights_step, "busy_s": busy,
                        "waited_s": waited, **turns}, [comp.logps])
        waited, waited_since = 0.0, time.perf_counter()
    lk.flush()
    if gen is not None:
        gen.close()
    print(f"generation rank {lay.rank}: stopped by trainer 0", file=sys.stderr)
    return PREEMPTED_EXIT_CODE if signals.pending() else 0


def received_weights(lk) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from trainer 0's buckets, until an empty one."""
    while True:
        meta = lk.broadcast_json()
        if not meta["names"]:
            return
        numel = sum(math.prod(s) for s in meta["shapes"])
        flat = lk.broadcast(torch.empty(numel, dtype=getattr(torch, meta["dtype"])))
        offset = 0
        for name, shape in zip(meta["names"], meta["shapes"]):
            n = math.prod(shape)
            yield name, flat[offset:offset + n].view(shape)
            offset += n


def load_into(model, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """The trainers' weights into the model's parameters, by name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in weights:
        if name not in params:
            raise ValueError(f"the trainers sent weights for {name!r}, which this rank's copy of the model lacks")
        if params[name].dtype != value.dtype:  # the trainer's precision (bf16 on GPUs): generate in it
            model.to(value.dtype)
            params = dict(model.named_parameters(remove_duplicate=False))
        params[name].data.copy_(value)


def untie(model) -> None:
    """A LoRA layer on a tied head: the trainers send the merged head apart from the embeddings, so the two stop
    sharing one matrix here (as the trainers' merged policy does)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
