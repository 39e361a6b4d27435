"""Rollout buffer: padding layout, per-pass schedule, old log-prob bookkeeping, exact state round trip."""
import torch

from recipe.buffer import RolloutBuffer


def make(n=8, order_seed=3):
    prompts = [[5 + i] * (2 + i % 3) for i in range(n)]
    comps = [[7] * (1 + i % 4) for i in range(n)]
    mask = torch.zeros(n, 4)
    for i, c in enumerate(comps):
        mask[i, :len(c)] = 1
    return RolloutBuffer.build(prompts, comps, torch.arange(n, dtype=torch.float), mask, pad_id=0,
                               order_seed=order_seed), prompts, comps


def test_layout_left_padded_prompts_right_padded_completions():
    buf, prompts, comps = make()
    assert buf.input_ids.shape == (8, 4 + 4) and buf.prompt_length == 4
    for i in range(8):
        p, c = prompts[i], comps[i]
        assert buf.input_ids[i, 4 - len(p):4].tolist() == p
        assert buf.attention_mask[i].tolist() == [0] * (4 - len(p)) + [1] * len(p) + [1] * len(c) + [0] * (4 - len(c))
        assert buf.input_ids[i, 4:4 + len(c)].tolist() == c


def test_schedule_covers_every_sample_once_per_pass_and_reshuffles():
    buf, _, _ = make()
    orders = []
    for p in range(3):
        sched = buf.schedule(p, steps=2, micro_batch_size=2)
        assert len(sched) == 2 and all(len(step) == 2 for step in sched)
        flat = torch.cat([torch.cat(step) for step in sched]).tolist()
        assert sorted(flat) == list(range(8))
        orders.append(flat)
    assert orders[0] != orders[1] or orders[1] != orders[2]
    assert buf.schedule(1, 2, 2)[0][0].tolist() == make()[0].schedule(1, 2, 2)[0][0].tolist()  # deterministic


def test_plan_is_each_pass_schedule_and_token_counts_follow_it():
    buf, _, _ = make()
    plan = buf.plan(passes=2, steps=2, micro_batch_size=2)
    assert [[[i.tolist() for i in step] for step in sched] for sched in plan] == \
        [[[i.tolist() for i in step] for step in buf.schedule(p, 2, 2)] for p in range(2)]
    counts = buf.token_counts(plan)
    assert counts.shape == (2, 2)
    assert counts.sum(dim=1).tolist() == [buf.completion_mask.sum().item()] * 2
    first = torch.cat(plan[0][0])
    assert counts[0, 0].item() == buf.completion_mask[first].sum().item()


def test_old_logps_and_exact_state_round_trip():
    buf, _, _ = make()
    assert not buf.has_old_logps.any() and torch.isnan(buf.old_logps).all()
    idx = torch.tensor([1, 4])
    buf.store_old_logps(idx, torch.full((2, 4), -1.5))
    assert buf.has_old_logps.tolist() == [i in (1, 4) for i in range(8)]
    state = buf.state_dict()
    torch.save(state, "/dev/null")  # plain tensors and ints
    again = RolloutBuffer.from_state_dict(state)
    for k, v in state.items():
        w = getattr(again, k)
        assert (v == w) if not isinstance(v, torch.Tensor) else torch.equal(v.nan_to_num(7), w.nan_to_num(7))
    mb = again.micro_batch(idx)
    assert mb["old_logps"].eq(-1.5).all() and mb["advantages"].tolist() == [1.0, 4.0]


def test_sampling_logps_stored_and_round_tripped():
    buf, prompts, comps = make()
    assert torch.isnan(buf.sampling_logps).all() and buf.sampling_logps.shape == (8, 4)  # backend without them
    lps = -torch.rand(8, 4, dtype=torch.float64)
    mask = buf.completion_mask
    again = RolloutBuffer.build(prompts, comps, buf.advantages, mask, pad_id=0, order_seed=3, sampling_logps=lps)
    assert again.sampling_logps.dtype == torch.float32 and torch.equal(again.sampling_logps, lps.float())
    restored = RolloutBuffer.from_state_dict(again.state_dict())
    assert torch.equal(restored.sampling_logps, again.sampling_logps)
    # samples 2 and 5 have completions of 3 and 2 tokens: the micro-batch keeps 3 columns
    assert torch.equal(restored.micro_batch(torch.tensor([2, 5]))["sampling_logps"], lps.float()[[2, 5], :3])


def test_each_step_trains_todays_samples_grouped_by_length():
    """Which samples an optimizer step trains on is today's shuffle; within the step, micro-batches go from the
    longest samples to the shortest."""
    buf, prompts, comps = make(n=12)
    for p in range(3):
        todays = torch.randperm(12, generator=torch.Generator().manual_seed(3 * 1000 + p))
        for s, step in enumerate(buf.schedule(p, steps=2, micro_batch_size=2)):
            assert sorted(torch.cat(step).tolist()) == sorted(todays[s * 6:(s + 1) * 6].tolist())
            lengths = [(len(comps[i]), len(prompts[i])) for i in torch.cat(step).tolist()]
            assert lengths == sorted(lengths, reverse=True)


def test_micro_batch_drops_columns_that_are_padding_in_all_its_samples():
    buf, prompts, comps = make()
    idx = torch.tensor([4, 0])  # prompts of 3 and 2 tokens (buffer width 4), completions of 1 token each
    mb = buf.micro_batch(idx)
    assert mb["input_ids"].shape == (2, 3 + 1) and mb["completion_mask"].shape == (2, 1)
    assert mb["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert mb["input_ids"][0].tolist() == prompts[4] + comps[4] and mb["input_ids"][1, 1:].tolist() == prompts[0] + comps[0]
    # old log-probs of a trimmed micro-batch: the columns it did not have are stored as padding (0)
    buf.store_old_logps(idx, torch.tensor([[-1.0], [-2.0]]))
    assert buf.old_logps[4].tolist() == [-1.0, 0, 0, 0] and buf.micro_batch(idx)["old_logps"].tolist() == [[-1.0], [-2.0]]
