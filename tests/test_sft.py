"""model/sft.py and tools/sft.py: the warm-up trains the assistant's tokens only, and learns them; bad data is
one line."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from grpo_recipe.model.sft import assistant_tokens, warm_up
from grpo_recipe.model.tiny import build_model, build_tokenizer
from grpo_recipe.examples.tool_games import Lamp, _call, _schema


def conversation():
    return [{"role": "user", "content": "Light the lamp."}, _call("switch"),
            {"role": "tool", "name": "switch", "content": "on"}, {"role": "assistant", "content": "Done."}]


def test_only_the_assistants_tokens_are_trained():
    tok = build_tokenizer(chatml=True)
    tools = [_schema(Lamp().switch)]
    ids, mask = assistant_tokens(tok, conversation(), tools)
    assert ids == tok.apply_chat_template(conversation(), tools=tools, tokenize=True, return_dict=False)
    trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == ('<tool_call>{"name": "switch", "arguments": {}}</tool_call><|im_end|>\n'
                       'Done.<|im_end|>\n')  # the calls and the answer; not the prompt, the tool's result, headers
    context = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert "Light the lamp." in context and "<|im_start|>tool\non<|im_end|>" in context


def test_the_warm_up_learns_the_assistants_turns():
    tok = build_tokenizer(chatml=True)
    model = build_model(tok)
    rows = [{"messages": conversation(), "tools": [_schema(Lamp().switch)]}]
    losses = warm_up(model, tok, rows, steps=40, learning_rate=1e-2, batch_size=2)
    assert losses[-1] < 0.2 * losses[0], losses


@pytest.mark.parametrize("content, extra, says", [
    ("not json\n", [], "cannot read"), ('{"text": "hi"}\n', [], "messages"),
    ('{"messages": []}\n', ["--chat-template", "no/such.jinja"], "chat_template_path: file not found"),
    ('{"messages": []}\n', ["--model", "no/such/model"], "no/such/model"),
])
def test_bad_warm_up_input_is_one_line_before_any_model_loads(tmp_path, content, extra, says):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.tools.sft", "--model", "builtin:tiny-qwen2", "--data",
                           str(data), "--out", str(tmp_path / "o"), *extra], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()
