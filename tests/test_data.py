"""Prompt data: file formats, dataset configs and split slices, chat template, system prompt and template
kwargs, conversational prompts, left truncation and padding, rank shards, epoch order, named column errors,
eval prompts."""
import gzip
import json

import pytest
import torch

from grpo_recipe.algo.buffer import left_pad
from grpo_recipe.config.schema import Config
from grpo_recipe.data.prompts import (
    DataError,
    PromptStream,
    check_prompts,
    load_datasets,
    load_prompt_dataset,
    uses_chat_template,
)
from grpo_recipe.model.load import load_tokenizer


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


@pytest.mark.parametrize("fmt", ["csv", "parquet", "json", "tsv", "jsonl.gz", "arrow", "txt", "saved"])
def test_other_file_formats(tmp_path, tok, fmt):
    import datasets
    import pyarrow as pa

    ds = datasets.Dataset.from_list([{"question": f"q{i}"} for i in range(4)])
    path = tmp_path / f"p.{fmt}"
    if fmt == "txt":  # one prompt per line, in datasets' column "text"
        path.write_text("".join(f"q{i}\n" for i in range(4)))
        ds = ds.rename_column("question", "text")
    elif fmt == "arrow":  # an Arrow IPC stream, as datasets writes its own cache files
        table = ds.data.table
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif fmt == "tsv":
        ds.to_csv(str(path), sep="\t", index=False)
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ds.to_list()).encode()))
    elif fmt == "saved":  # a save_to_disk folder
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(path))
    else:
        getattr(ds, f"to_{fmt}")(str(path))
    column = ds.column_names[0]
    cfg = cfg_for(path, prompt_column=column)
    assert load_prompt_dataset(cfg)[column][:] == ["q0", "q1", "q2", "q3"]
    assert load_prompt_dataset(cfg_for(path, prompt_column=column, dataset_split="train[1:3]"))[column][:] \
        == ["q1", "q2"]


def write_two_config_dataset(folder):
    """A local dataset folder whose README.md lists two configs, as hub datasets such as GSM8K do."""
    for config, rows in (("main", ["m0", "m1", "m2", "m3"]), ("socratic", ["s0", "s1"])):
        (folder / config).mkdir(parents=True)
        write_jsonl(folder / config / "train.jsonl", [{"question": q, "answer": "#### 1"} for q in rows])
    (folder / "README.md").write_text("""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
Two configs, like openai/gsm8k (main, socratic).
""")
    return folder


def test_dataset_config_picks_the_config_and_split_slices(tmp_path):
    folder = write_two_config_dataset(tmp_path / "gsm")
    load = lambda **kw: load_prompt_dataset(cfg_for(folder, prompt_column="question", **kw))["question"][:]  # noqa: E731
    assert load(dataset_config="socratic") == ["s0", "s1"]
    assert load(dataset_config="main") == ["m0", "m1", "m2", "m3"]
    assert load(dataset_config="main", dataset_split="train[:50%]") == ["m0", "m1"]
    assert load(dataset_config="main", dataset_split="train[-1:]") == ["m3"]
    with pytest.raises(DataError, match=r"^dataset_config: .*pick one among the available configs: "
                                        r"\['main', 'socratic'\]"):
        load()
    with pytest.raises(DataError, match=r"^dataset_config: .*'nope' not found"):
        load(dataset_config="nope")
    with pytest.raises(DataError, match=r"^dataset_split: .*Unknown split \"test\""):
        load(dataset_config="main", dataset_split="test")
    with pytest.raises(DataError, match=r"^dataset_config: .* is a single file"):
        load_prompt_dataset(cfg_for(folder / "main" / "train.jsonl", prompt_column="question", dataset_config="main"))


def test_eval_dataset_config_picks_the_eval_sets_config(tmp_path):
    """A local train file and an eval dataset with configs (GSM8K's main): the eval set has its own config."""
    folder = write_two_config_dataset(tmp_path / "gsm")
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "t0", "answer": "#### 1"}])
    cfg = cfg_for(train, prompt_column="question", eval_dataset_name=str(folder), eval_dataset_split="train",
                  eval_dataset_config="socratic")
    train_set, eval_set = load_datasets(cfg)
    assert train_set["question"][:] == ["t0"] and eval_set["question"][:] == ["s0", "s1"]
    # null: the train set's config, which a single eval file ignores
    inherit = cfg_for(folder, prompt_column="question", dataset_config="main", eval_dataset_name=str(train))
    assert load_datasets(inherit)[1]["question"][:] == ["t0"]
    with pytest.raises(DataError, match=r"^eval_dataset_config: .* is a single file"):
        load_datasets(cfg_for(folder, prompt_column="question", dataset_config="main", eval_dataset_name=str(train),
                              eval_dataset_config="main"))
    with pytest.raises(DataError, match=r"^eval_dataset_config: .*'nope' not found"):
        load_datasets(cfg_for(train, prompt_column="question", eval_dataset_name=str(folder),
                              eval_dataset_split="train", eval_dataset_config="nope"))


def chat_tokenizer(tok, folder):
    """The tiny tokenizer with a chat template (it has none), saved and reloaded as a user's would be."""
    from grpo_recipe.model.load import load_tokenizer

    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>")
    try:
        tok.save_pretrained(folder)
    finally:
        tok.chat_template = None
    return load_tokenizer(str(folder))


def test_system_prompt_and_template_kwargs_reach_the_tokens(tmp_path, tok):
    chat_tok = chat_tokenizer(tok, tmp_path / "tok")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": "hello"}])
    cfg = cfg_for(path, system_prompt="Think step by step.", chat_template_kwargs={"enable_thinking": False})
    batch = PromptStream(load_prompt_dataset(cfg), chat_tok, cfg, 0, 1).batch(0)
    assert chat_tok.decode(batch.prompt_ids[0]) == "<system>Think step by step.<user>hello<nothink><assistant>"
    plain = cfg_for(path, system_prompt="Think step by step.")
    batch = PromptStream(load_prompt_dataset(plain), tok, plain, 0, 1).batch(0)  # no template: a text prefix
    assert tok.decode(batch.prompt_ids[0]) == "Think step by step.\n\nhello"
    with pytest.raises(DataError, match="^chat_template_kwargs: given, but no chat template is applied"):
        PromptStream(load_prompt_dataset(cfg), tok, cfg, 0, 1)


def test_conversational_prompts(tmp_path, tok):
    chat_tok = chat_tokenizer(tok, tmp_path / "tok")
    rows = [{"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": "yo"}], "answer": "2"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = cfg_for(path, system_prompt="Default.", per_device_train_batch_size=4)  # both rows
    stream = PromptStream(load_prompt_dataset(cfg), chat_tok, cfg, 0, 1)
    batch = stream.batch(0)
    texts = sorted(chat_tok.decode(ids) for ids in batch.prompt_ids)
    assert texts == ["<system>Default.<user>yo<assistant>", "<system>Own.<user>hi<assistant>"]  # a row's own wins
    assert sorted(p[-1]["content"] for p in batch.prompts) == ["hi", "yo"]  # as in the dataset, for rewards
    assert "prompt" not in batch.columns and sorted(batch.columns["answer"]) == ["1", "2"]
    off = cfg_for(path, chat_template=False)
    with pytest.raises(DataError, match="^prompt_column: 'prompt' holds chat messages, but no chat template"):
        PromptStream(load_prompt_dataset(off), chat_tok, off, 0, 1).batch(0)


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


def test_data_errors_name_the_field_or_column(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match="^prompt_column: dataset .* has no column 'prompt'"):
        load_prompt_dataset(cfg_for(path))
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": 3}, {"prompt": 4}])
    with pytest.raises(DataError, match=r"^prompt_column: column 'prompt' of .* holds Value\('int64'\), expected text"):
        load_prompt_dataset(cfg_for(path))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": {"text": "x"}}])
    with pytest.raises(DataError, match="^prompt_column: column 'prompt' of .* expected text or a list of chat"):
        load_prompt_dataset(cfg_for(path))
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x", "completions": "y"}])
    with pytest.raises(DataError, match=r"column\(s\) \['completions'\] .* collide with the reward functions"):
        load_prompt_dataset(cfg_for(path))
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": ""}, {"prompt": ""}])
    cfg = cfg_for(path)
    with pytest.raises(DataError, match="^prompt_column: row 0 of .* has an empty 'prompt'"):
        check_prompts(load_prompt_dataset(cfg), cfg, chat=False)  # every row, when the data loads
    bad = tmp_path / "p.xyz"
    bad.write_text("x")
    with pytest.raises(DataError, match="^dataset_name: cannot load .*p.xyz"):
        load_prompt_dataset(cfg_for(bad))


@pytest.mark.parametrize("rows, chat, message", [
    ([{"prompt": "a"}, {"prompt": None}], False, "row 1 of .* has no 'prompt' \\(null\\)"),
    ([{"prompt": "a"}, {"prompt": "b"}, {"prompt": ""}], False, "row 2 of .* has an empty 'prompt'"),
    ([{"prompt": " \n\t"}], False, "row 0 of .* has an empty 'prompt'"),
    ([{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": []}], True, "row 1 of .* empty list of chat messages"),
    ([{"prompt": "a"}, {"prompt": {"text": "b"}}], False, "row 1 of .* has a 'prompt' of type dict \\(\"{'text': 'b'}\"\\); "
                                                          "a prompt is text or a list of chat messages"),
    ([{"prompt": "a"}, {"prompt": 7}], False, "row 1 of .* has a 'prompt' of type int \\('7'\\)"),
    ([{"prompt": "a"}, {"prompt": [{"role": "user"}]}], True,
     "row 1 of .* has a chat message without a 'role' and 'content'"),
    ([{"prompt": "a"}, {"prompt": [None]}], True, "row 1 of .* has a chat message without a 'role' and 'content': 'None'"),
    ([{"prompt": "a"}, {"prompt": ["hi", "there"]}], True, "row 1 of .* has a chat message without a 'role' and 'content': 'hi'"),
    ([{"prompt": [{"role": "user", "content": "hi"}]}], None, "row 0 of .* holds chat messages, but the tokenizer "
                                                              "of .* has no chat template"),
])
def test_every_prompt_is_checked_when_the_data_loads(tmp_path, tok, rows, chat, message):
    cfg = cfg_for(write_jsonl(tmp_path / "p.jsonl", rows))
    with pytest.raises(DataError, match=f"prompt_column: {message}"):  # None: as the tiny tokenizer says
        check_prompts(load_prompt_dataset(cfg), cfg, uses_chat_template(tok, cfg) if chat is None else chat)


def test_good_prompts_pass_and_chat_messages_need_the_template(tmp_path, tok):
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)])
    text = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"prompt {i}"} for i in range(3)])
    check_prompts(load_prompt_dataset(cfg_for(text)), cfg_for(text), chat=False)
    check_prompts(load_prompt_dataset(cfg_for(chat)), cfg_for(chat), chat=True)
    with pytest.raises(DataError, match="holds chat messages, but chat_template: false"):
        check_prompts(load_prompt_dataset(cfg_for(chat)), cfg_for(chat, chat_template=False), chat=False)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file_is_named(tmp_path, text):
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(DataError, match=r"dataset_name: .*p.jsonl is empty \(\d+ bytes, no rows\)"):
        load_prompt_dataset(cfg_for(tmp_path / "p.jsonl"))
def test_eval_prompts_from_their_own_file_or_held_out_of_the_train_set(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"train {i}", "answer": str(i)} for i in range(10)])
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"eval {i}", "answer": str(i)} for i in range(3)])
    ds, ev = load_datasets(cfg_for(train))
    assert len(ds) == 10 and ev is None
    ds, ev = load_datasets(cfg_for(train, eval_dataset_name=str(evals)))
    assert len(ds) == 10 and list(ev["prompt"]) == ["eval 0", "eval 1", "eval 2"]
    ds, ev = load_datasets(cfg_for(train, eval_holdout_size=4))
    again = load_datasets(cfg_for(train, eval_holdout_size=4))[1]
    assert len(ds) == 6 and len(ev) == 4 and list(ev["prompt"]) == list(again["prompt"])  # fixed by the seed
    # a split, no overlap
    assert sorted(list(ds["prompt"]) + list(ev["prompt"])) == sorted(f"train {i}" for i in range(10))
    assert list(load_datasets(cfg_for(train, eval_holdout_size=4, seed=7))[1]["prompt"]) != list(ev["prompt"])
    # eval rows are formatted and truncated like training prompts
    stream = PromptStream(ev, tok, cfg_for(train, max_prompt_length=2), 0, 1)
    batch = stream.rows([0, 1])
    assert list(batch.prompts) == list(ev["prompt"])[:2] and all(len(p) == 2 for p in batch.prompt_ids)
    with pytest.raises(DataError, match="eval_holdout_size: 10 leaves no training prompts"):
        load_datasets(cfg_for(train, eval_holdout_size=10))
    with pytest.raises(DataError, match="^prompt_column: dataset .*bad.jsonl has no column 'prompt'"):
        load_datasets(cfg_for(train, eval_dataset_name=str(write_jsonl(tmp_path / "bad.jsonl", [{"q": "x"}]))))
    # a split of the eval file: slices work, and an error names the eval field
    ds, ev = load_datasets(cfg_for(train, eval_dataset_name=str(evals), eval_dataset_split="train[1:]"))
    assert list(ev["prompt"]) == ["eval 1", "eval 2"]
    with pytest.raises(DataError, match="^eval_dataset_split: cannot load .*eval.jsonl.* split 'validation'"):
        load_datasets(cfg_for(train, eval_dataset_name=str(evals), eval_dataset_split="validation"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="^eval_dataset_name: .*empty.jsonl is empty"):
        load_datasets(cfg_for(train, eval_dataset_name=str(tmp_path / "empty.jsonl")))
    # every eval prompt is checked as the train prompts are, naming the eval file
    bad = write_jsonl(tmp_path / "bad_prompt.jsonl", [{"prompt": "x"}, {"prompt": ""}])
    cfg = cfg_for(train, eval_dataset_name=str(bad))
    with pytest.raises(DataError, match="^prompt_column: row 1 of .*bad_prompt.jsonl has an empty 'prompt'"):
        check_prompts(load_datasets(cfg)[1], cfg, chat=False, name=cfg.eval_dataset_name)
