"""generation/tools.py: loading tools, calling them within bounds, and the multi-turn loop, whose tokens and masks
equal TRL 1.16's own `_tool_call_loop` on the same model turns."""
import copy
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import needs_vllm

from grpo_recipe.config.schema import Config, ConfigError, validate
from grpo_recipe.generation.base import finish
from grpo_recipe.generation.tools import (ToolError, ToolRunner, check_template, load_tools, multi_turn, parse,
                                          set_templates, tool_suffix)
from grpo_recipe.model.tiny import build_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.chat_template_utils import parse_response as trl_parse_response  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

HERE = os.path.dirname(__file__)
TOOLS_FILE = os.path.join(HERE, "data", "tools_fixture.py")


def tokenizer():
    """The built-in tiny tokenizer with ChatML's turn markers, EOS ending a turn, and the shipped tool templates."""
    tok = build_tokenizer()
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    set_templates(tok, Config(chat_template_path="grpo_recipe/assets/chatml_tools.jinja",
                              response_template_path="grpo_recipe/assets/chatml_tools_response.json"))
    return tok


def test_a_typed_documented_function_becomes_a_tool_with_its_schema():
    (add,) = load_tools([f"{TOOLS_FILE}:add"])
    assert add.name == "add" and add.fn(2, 3) == 5
    params = add.schema["function"]["parameters"]
    assert params["properties"]["a"]["type"] == "integer" and params["required"] == ["a", "b"]


@pytest.mark.parametrize("spec, says", [
    (f"{TOOLS_FILE}:untyped", "no usable schema"),
    (f"{TOOLS_FILE}:no_docstring", "no usable schema"),
    (f"{TOOLS_FILE}:missing", "has no function 'missing'"),
    ("no_such_module_xyz:f", "cannot import module"),
    ("tests/data/nope.py:f", "file not found"),
])
def test_an_unusable_tool_is_one_line_naming_it(spec, says):
    with pytest.raises(ToolError) as e:
        load_tools([spec])
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("tools: ")


def test_a_template_that_ignores_tools_or_cannot_read_calls_is_refused():
    tools = load_tools([f"{TOOLS_FILE}:add"])
    plain = build_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ToolError, match="ignores `tools`"):
        check_template(plain, [t.schema for t in tools])
    tok = tokenizer()
    tok.response_template = None
    with pytest.raises(ToolError, match="no response template"):
        check_template(tok, [t.schema for t in tools])
    check_template(tokenizer(), [t.schema for t in tools])  # the shipped pair serves


def test_tools_are_refused_where_the_loop_cannot_run():
    with pytest.raises(ConfigError, match="chat_template is false"):
        validate(Config(tools=["m:f"], chat_template=False))
    with pytest.raises(ConfigError, match="max_tool_calling_iterations"):
        validate(Config(tools=["m:f"], max_tool_calling_iterations=0))
    with pytest.raises(ConfigError, match="environment_factory: environments live where the trainers score"):
        validate(Config(environment_factory="m:C", generation_ranks=1), world_size=2)
    validate(Config(tools=["m:f"], generation_ranks=1), world_size=2)  # tools run on the generation rank


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_failing_hanging_or_unprintable_tool_is_a_result_the_model_reads_and_a_counted_failure():
    runner = ToolRunner(load_tools([f"{TOOLS_FILE}:{n}" for n in ("add", "fails", "hangs", "unprintable")]), 0.5)
    assert runner.call(call("add", a=2, b=3)) == ("add", "5", False)
    assert runner.call(call("fails", x=1)) == ("fails", "{'error': 'no luck with 1'}", True)
    start = time.monotonic()
    name, text, failed = runner.call(call("hangs", seconds=30.0))
    assert failed and "timed out after 0.5 s" in text and time.monotonic() - start < 5
    assert runner.call(call("unprintable"))[2]
    assert runner.call(call("nope")) == ("nope", "{'error': 'Tool nope not found.'}", True)
    assert runner.call(call("add", a=1))[2]  # a missing argument


# --- the loop against TRL's own -------------------------------------------------------------------------------
# Each sample's model turns, by sample and by the number of tool rounds before them.
SCRIPT = {
    0: ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>', "s0 it is 5<|im_end|>"],
    1: ["s1 no tools needed<|im_end|>"],
    2: ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call><|im_end|>',
        'again <tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>', "s2 four<|im_end|>"],
    3: ['<tool_call>{"name": "fails", "arguments": {"x": 7}}</tool_call><|im_end|>', "s3 it failed<|im_end|>"],
    4: ['<tool_call>{"name": "add", "arguments": {"a": 4, "b": 4}}</tool_call><|im_end|>',
        "s4 " + "and on " * 60 + "<|im_end|>"],  # runs past the budget: truncated
    5: ['<tool_call>{"name": "nope", "arguments": {}}</tool_call><|im_end|>', "s5 fine<|im_end|>"],
    6: ['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><|im_end|>'],  # not JSON: text, no call
    7: ['<tool_call>{"name": 5, "arguments": {}}</tool_call><|im_end|>'],  # no function name: text, no call
}
MARKS = {0: "\"a\": 2, \"b\": 3", 2: "\"a\": 1, \"b\": 1", 3: "fails",
         4: "\"a\": 4", 5: "nope", 1: "s1 no tools", 6: "\"a\": 1</tool_call>", 7: "\"name\": 5"}
MAX_LEN = 160


def model_turn(tok, context_ids: list[int], first: int | None = None) -> list[int]:
    """The scripted model: which sample (from its first turn in the context) and how many tool results it read."""
    text = tok.decode(context_ids, skip_special_tokens=False)
    text = text[text.index("<|im_start|>assistant\n"):]  # the completion so far (the prompt lists the tools)
    if first is None:
        first = next(i for i, m in MARKS.items() if m in text)
    rounds = text.count("<|im_start|>tool")
    return tok(SCRIPT[first][rounds], add_special_tokens=False)["input_ids"]


def our_side(tok, prompt_ids, runner, max_iterations):
    cfg = Config(max_completion_length=MAX_LEN, max_tool_calling_iterations=max_iterations, num_generations=2)

    def generate(prompts, n, k):
        raw = [model_turn(tok, p, first=j if k == 0 else None) for j, p in enumerate(
            [p for p in prompts for _ in range(n or 2)])]
        return finish(raw, tok.eos_token_id, tok, MAX_LEN)

    return multi_turn(generate, tok, cfg, prompt_ids, runner, max_model_len=4096)


def trl_side(tok, messages, prompt_ids, runner, max_iterations):
    """TRL 1.16's `_tool_call_loop` itself, on a stand-in for the trainer state it reads."""
    tools = list(runner.tools.values())
    me = SimpleNamespace(
        _sync_tool_dicts=[dict(runner.tools)] * 8, _async_tool_dicts=[{}] * 8, max_tool_calling_iterations=max_iterations,
        use_vllm=False, model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)), _is_vlm=False,
        max_completion_length=MAX_LEN, environment_factories=None, tools=tools, processing_class=tok,
        _tokenizer=tok, chat_template=None, chat_template_kwargs={})
    me._get_tool_suffix_ids = lambda msgs: GRPOTrainer._get_tool_suffix_ids(me, msgs)
    me._generate_single_turn = lambda ids, *a, **k: ([model_turn(tok, x) for x in ids], None)
    first = [model_turn(tok, p, first=j) for j, p in enumerate(prompt_ids)]
    first = [f[:f.index(tok.eos_token_id) + 1] for f in first]
    completions = [[trl_parse_response(tok, f, prefix=p, tools=[t.schema for t in runner_tools])]
                   for f, p in zip(first, prompt_ids)]  # as TRL's _generate reads first turns
    return GRPOTrainer._tool_call_loop(me, copy.deepcopy(messages), prompt_ids, [list(f) for f in first],
                                       completions, None, None, None)


runner_tools = load_tools([f"{TOOLS_FILE}:add", f"{TOOLS_FILE}:fails"])


@pytest.mark.parametrize("max_iterations", [None, 1], ids=["unbounded", "one_round"])
def test_the_loop_gives_trls_tokens_tool_mask_and_counts(max_iterations):
    tok = tokenizer()
    runner = ToolRunner(runner_tools, 5.0)
    questions = [[{"role": "user", "content": f"question {q}"}] for q in range(4)]
    prompt_ids = [tok.apply_chat_template(m, tools=runner.schemas, tokenize=True, add_generation_prompt=True,
                                          return_dict=False) for m in questions]
    ours = our_side(tok, prompt_ids, runner, max_iterations)
    per_sample = [p for p in prompt_ids for _ in range(2)]
    theirs = trl_side(tok, [m for m in questions for _ in range(2)], per_sample, runner,
                      max_iterations if max_iterations is not None else 10**9)
    tool_mask, completions, completion_ids, _, calls, failures, _ = theirs
    assert ours.ids == completion_ids
    for i, (ids, m) in enumerate(zip(ours.ids, tool_mask)):
        assert ours.tool_mask[i, :len(ids)].tolist() == [float(x) for x in m]
        assert ours.mask[i].sum() == len(ids)
    assert (ours.tool_counts["tool_calls"], ours.tool_counts["tool_failures"]) == (calls, failures)
    # what the cases must exercise, or the equality proves little
    assert 0.0 in ours.tool_mask[0].tolist() and ours.tool_mask[1, :len(ours.ids[1])].all()  # a tool turn; none
    assert failures == 2  # the raising tool and the unknown one, in the first round
    if max_iterations is None:
        assert ours.truncated.tolist() == [False, False, False, False, True, False, False, False]
        assert len(ours.ids[4]) == MAX_LEN
        assert [m["role"] for m in ours.turns[2]] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert ours.turns[0][1]["content"] == "5" and ours.turns[0][-1]["content"] == "s0 it is 5"
    else:
        assert [m["role"] for m in ours.turns[2]] == ["assistant", "tool", "assistant"]  # its second call unrun
    assert ours.texts[0].startswith('<tool_call>{"name": "add"')
    assert all(len(t) == 1 and "tool_calls" not in t[0] for t in ours.turns[6:])  # malformed calls: text
    assert (completions[6][-1].get("tool_calls"), completions[7][-1].get("tool_calls")) == (None, None)


def test_the_tool_suffix_is_the_templates_tool_turn_and_the_next_assistant_header():
    tok = tokenizer()
    suffix = tool_suffix(tok, [{"role": "tool", "name": "add", "content": "5"}], {})
    assert tok.decode(suffix, skip_special_tokens=False) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    turn = tok("hello<|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse(tok, turn, [], [])["content"] == "hello"


@pytest.mark.slow
def test_the_tools_quickstart_learns_to_call_and_counts_its_calls(tmp_path):
    from conftest import torchrun

    from grpo_recipe.run.metrics import read_jsonl

    out = tmp_path / "out"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_tools.yaml",
                 "--disable_tqdm", "true", "--output_dir", str(out), "--log_completions_steps", "30"])
    records = read_jsonl(out / "metrics.jsonl")
    quarter = len(records) // 4
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    first, last = mean(records[:quarter], "reward_mean"), mean(records[-quarter:], "reward_mean")
    assert last > first + 0.15, (first, last)  # only the word the tool returns pays
    assert mean(records[-quarter:], "tool_calls_per_completion") > mean(records[:quarter], "tool_calls_per_completion")
    assert all(0 < r["tool_tokens_per_completion"] < r["completion_length_mean"] for r in records)
    samples = read_jsonl(out / "completions.jsonl")
    called = [s for s in samples if any(m["role"] == "tool" for m in s["turns"])]
    results = [m["content"] for s in called for m in s["turns"] if m["role"] == "tool"]
    assert "swordfish" in results  # what the tool returns, or what a misspelt call gets back
    assert all(r == "swordfish" or r.startswith("{'error': 'Tool ") for r in results), results


def test_the_calculator_example_computes_and_refuses_anything_but_arithmetic():
    from grpo_recipe.examples.calculator import calculator, correct_final_answer

    assert calculator("37 * 41 + 19") == "1536" and calculator("-5 - 2 * 3") == "-11"
    for bad in ("__import__('os')", "2 ** 99999", "1 / 0", "x + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    turns = [[{"role": "assistant", "content": "Answer: 1536"}], [{"role": "tool", "content": "1536"}], "1536"]
    assert correct_final_answer(None, turns, ["1536"] * 3) == [1.0, 0.0, 1.0]


@pytest.mark.slow
def test_a_generation_rank_runs_the_tool_rounds_as_the_trainers_would(tmp_path):
    """2 trainers + 1 generation rank: the first rollout (sampled from the same weights, with the same seeds per
    round) is the colocated run's, tool calls, tool tokens and rewards alike; later ones sample from the sent
    weights."""
    from conftest import torchrun

    from grpo_recipe.run.metrics import read_jsonl

    run = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_tools.yaml", "--disable_tqdm", "true",
           "--max_steps", "2", "--log_completions_steps", "1"]
    torchrun(2, [*run, "--output_dir", str(tmp_path / "colocated")])
    torchrun(3, [*run, "--output_dir", str(tmp_path / "apart"), "--generation_ranks", "1"])
    keys = ("reward_mean", "tool_calls_per_completion", "tool_tokens_per_completion", "completion_length_mean")
    first = [read_jsonl(tmp_path / side / "metrics.jsonl")[0] for side in ("colocated", "apart")]
    assert [first[0][k] for k in keys] == [first[1][k] for k in keys] and first[0]["tool_calls_per_completion"] > 0
    turns = [[s["turns"] for s in read_jsonl(tmp_path / side / "completions.jsonl") if s["generation"] == 0]
             for side in ("colocated", "apart")]
    assert turns[0] == turns[1]


@pytest.mark.slow
def test_lora_trains_only_the_adapter_on_multi_turn_rollouts_with_a_kl_to_the_base(tmp_path):
    """LoRA with tools, mu = 2 and beta > 0 (the reference is the base under the disabled adapter, scored on the
    same multi-turn tokens): the rounds run under the adapter, tool calls are counted, the KL is finite and moves
    off zero once the adapter has trained, and only the adapter is saved, trained away from its zero init."""
    from conftest import torchrun
    from safetensors.torch import load_file

    from grpo_recipe.run.metrics import read_jsonl

    out = tmp_path / "out"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_tools.yaml", "--disable_tqdm",
                 "true", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--beta", "0.04",
                 "--max_steps", "4", "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 4 and all(r["tool_calls_per_completion"] > 0 for r in records)
    kls = [r["kl"] for r in records]
    assert all(math.isfinite(k) for k in kls) and kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 0, kls
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # lora_B starts at zero


@pytest.mark.slow
@needs_vllm
def test_vllm_runs_the_tool_rounds_with_the_models_tokens_scored_apart(tmp_path):
    """Colocated vLLM: the rounds stay within its context, tool results are counted apart from the model's
    tokens, and the drift correction sees only the model's tokens (tool results carry no sampler log-prob)."""
    from conftest import torchrun

    from grpo_recipe.run.metrics import read_jsonl

    out = tmp_path / "out"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_tools.yaml", "--disable_tqdm",
                 "true", "--generation_backend", "vllm", "--max_steps", "4", "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    assert all(r["tool_calls_per_completion"] > 0 and 0 < r["tool_tokens_per_completion"] for r in records)
    assert all(r["is_zeroed_fraction"] < 0.5 for r in records if "is_zeroed_fraction" in r)
