"""Worker (torchrun, one rank): stop strings end completions on both generation backends.

For each backend named after OUT (hf, vllm), samples completions with
`stop` set and checks every one: it ends with EOS, or its text contains a stop string that the last token
completes (the text without that token has none), or it is as long as max_completion_length; its mask
covers exactly its tokens; the sampler's log-probs (vLLM) lie on the mask only. Writes OUT.json.
"""
import json
import sys

from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import build_generator
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.source import model_path

STOPS = ["on", "e"]  # frequent in the tiny model's random text, so most samples stop early


def check(comp, tok, cfg) -> dict:
    eos, stopped, bad = tok.eos_token_id, 0, []
    for i, ids in enumerate(comp.ids):
        text = tok.decode(ids, skip_special_tokens=False)
        before = tok.decode(ids[:-1], skip_special_tokens=False)
        ends_at_stop = any(s in text for s in STOPS) and not any(s in before for s in STOPS)
        stopped += ends_at_stop and ids[-1] != eos
        ok = ids[-1] == eos or ends_at_stop or len(ids) == cfg.max_completion_length
        ok = ok and int(comp.mask[i].sum()) == len(ids) and (not ends_at_stop or not comp.truncated[i])
        if comp.logps is not None:
            ok = ok and bool((comp.logps[i, len(ids):] == 0).all()) and bool((comp.logps[i, :len(ids)] < 0).all())
        if not ok:
            bad.append({"ids": ids, "text": text})
    return {"n": len(comp.ids), "stopped": stopped, "bad": bad, "texts": comp.texts}


def main():
    out, backends = sys.argv[1], sys.argv[2:]
    rank, world = init_distributed()
    report = {}
    generators = []
    for backend in backends:
        cfg = Config(generation_backend=backend, num_generations=8, per_device_train_batch_size=16,
                     max_completion_length=24, max_prompt_length=32, stop=STOPS)
        path = model_path(cfg)
        tok = load_tokenizer(path)
        engine = eng.init_engine(load_model(path, cfg), cfg, world) if not generators else generators[0][1]
        gen = build_generator(cfg, engine, tok)
        generators.append((gen, engine))
        prompts = [tok("TITLE: my landlord wants").input_ids, tok("POST: a question about").input_ids]
        report[backend] = check(gen.generate(prompts, seed=3), tok, cfg)
    json.dump(report, open(out, "w"))
    for gen, _ in generators:  # vLLM last: its shutdown tears the process group down
        gen.close()


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
