"""A short supervised warm-up on conversations: teaches a model a turn format (tool calls) before GRPO.

Plain PyTorch on one process: the loss is the cross-entropy of the assistant's tokens only (prompts, tool results
and the template's headers are context), found by rendering each conversation message by message with the chat
template, so it needs a template that renders a conversation's prefix as the prefix of its tokens.
"""
from __future__ import annotations

import random

import torch


def assistant_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """The conversation's token ids, and 1 on the tokens its assistant messages add (0 elsewhere)."""
    ids, mask = [], []
    for k, message in enumerate(messages):
        before = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=True, return_dict=False,
                                               add_generation_prompt=message["role"] == "assistant") if k else []
        after = tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=True, return_dict=False)
        if after[:len(before)] != before or after[:len(ids)] != ids:
            raise ValueError("the chat template does not render a conversation's prefix as the prefix of its tokens")
        trained = message["role"] == "assistant"
        mask += [0] * (len(before) - len(ids)) + [int(trained)] * (len(after) - len(before))
        ids = after
    return ids, mask


def warm_up(model, tokenizer, conversations: list[dict], steps: int, learning_rate: float, batch_size: int = 16,
            seed: int = 0, log=None) -> list[float]:
    """`steps` AdamW steps on batches drawn from `conversations` ({messages, tools}); returns the losses."""
    rows = [assistant_tokens(tokenizer, c["messages"], c.get("tools")) for c in conversations]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    losses = []
    pad = tokenizer.pad_token_id
    for step in range(steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros(len(batch), width)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, :len(x)], mask[i, :len(x)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(m).float(), 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (token_loss * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log is not None and (step % 50 == 0 or step == steps - 1):
            log(f"warm-up step {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return losses
