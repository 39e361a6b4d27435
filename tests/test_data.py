"""Prompt data: file formats, chat template, left truncation and padding, rank shards, epoch order."""
import json

import pytest
import torch

from recipe.config import Config
from recipe.data import DataError, PromptStream, left_pad, load_prompt_dataset
from recipe.engine import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_for(path, **kw):
    base = dict(dataset_name=str(path), num_generations=2, per_device_train_batch_size=2,
                gradient_accumulation_steps=1, max_prompt_length=64)
    return Config(**{**base, **kw})


def test_left_pad_puts_every_row_flush_right():
    ids, attn = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]] and ids.dtype == torch.long
    assert attn.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_shards_are_disjoint_and_cover_each_epoch(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt number {i}", "answer": str(i)} for i in range(12)])
    cfg = cfg_for(path)  # 1 prompt per rank per rollout
    ds = load_prompt_dataset(cfg)
    streams = [PromptStream(ds, tok, cfg, r, 3) for r in range(3)]
    seen = [i for k in range(4) for s in streams for i in s.indices(k)]  # 4 rollouts x 3 ranks = one epoch
    assert sorted(seen) == list(range(12))
    nxt = [i for k in range(4, 8) for s in streams for i in s.indices(k)]
    assert sorted(nxt) == list(range(12)) and nxt != seen  # the next epoch, reshuffled
    again = PromptStream(ds, tok, cfg, 1, 3)
    assert [again.indices(k) for k in range(8)] == [streams[1].indices(k) for k in range(8)]  # deterministic
    b = streams[0].batch(0)
    assert b.columns["answer"] == [str(b.columns["answer"][0])] and b.prompts[0].startswith("prompt number")
    rep = b.repeat(3)
    assert len(rep.prompt_ids) == 3 and rep.prompt_ids[0] == rep.prompt_ids[2]


def test_left_truncation_is_counted(tmp_path, tok):
    long = "word " * 200
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": long + "END"}, {"prompt": "short"}])
    cfg = cfg_for(path, max_prompt_length=16, per_device_train_batch_size=4)
    stream = PromptStream(load_prompt_dataset(cfg), tok, cfg, 0, 1)
    b = stream.batch(0)
    assert b.num_truncated == 1
    assert max(len(x) for x in b.prompt_ids) == 16
    longest = max(b.prompt_ids, key=len)
    assert tok.decode(longest).endswith("END")  # the end of the prompt is kept


@pytest.mark.parametrize("fmt", ["csv", "parquet", "json"])
def test_other_file_formats(tmp_path, tok, fmt):
    import datasets

    ds = datasets.Dataset.from_list([{"question": f"q{i}"} for i in range(4)])
    path = tmp_path / f"p.{fmt}"
    getattr(ds, f"to_{fmt}")(str(path))
    cfg = cfg_for(path, prompt_column="question")
    assert len(load_prompt_dataset(cfg)) == 4


def test_chat_template_applied_when_present(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": [{"role": "user", "content": "hi"}]}])
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    try:
        cfg = cfg_for(path)
        stream = PromptStream(load_prompt_dataset(cfg), tok, cfg, 0, 1)
        assert stream.format("hello") == "<user>hello<assistant>"
        assert stream.format([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
        off = PromptStream(load_prompt_dataset(cfg), tok, cfg_for(path, chat_template=False), 0, 1)
        assert off.format("hello") == "hello"
    finally:
        tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        PromptStream(load_prompt_dataset(cfg), tok, cfg_for(path, chat_template=True), 0, 1)


def test_data_errors(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="no column 'prompt'"):
        load_prompt_dataset(cfg_for(path))
    bad = tmp_path / "p.txt"
    bad.write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        load_prompt_dataset(cfg_for(bad))
