"""Rollout buffer: padding layout, per-pass schedule, old log-prob bookkeeping, exact state round trip."""
import torch

from grpo_recipe.algo.buffer import RolloutBuffer


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


def old_rule_schedule(buf, pass_index, steps, micro_batch_size):
    """The schedule before zero_std_filter existed: the pass's permutation cut into steps, then micro-batches."""
    order = torch.randperm(len(buf), generator=torch.Generator().manual_seed(buf.order_seed * 1000 + pass_index))
    per_step = len(buf) // steps
    return [[mb.tolist() for mb in order[s * per_step:(s + 1) * per_step].split(micro_batch_size)]
            for s in range(steps)]


def with_active(active, n=16):
    buf, prompts, comps = make(n)
    again = RolloutBuffer.build(prompts, comps, buf.advantages, buf.completion_mask, pad_id=0, order_seed=3,
                                active=torch.tensor(active))
    return buf, again


def test_all_active_schedule_is_unchanged_and_left_out_samples_are_never_trained():
    buf, same = with_active([True] * 16)
    for p in range(3):
        for steps, mbs in ((1, 4), (2, 2), (4, 2)):
            expected = [sorted(sum(step, [])) for step in old_rule_schedule(buf, p, steps, mbs)]
            for b in (buf, same):  # each step trains the old rule's samples (grouped by length within it)
                sched = b.schedule(p, steps, mbs)
                assert [sorted(torch.cat(step).tolist()) for step in sched] == expected
                assert all(len(mb) == mbs for step in sched for mb in step)
    # groups of 4: group 1 and group 3 had all-equal rewards and are left out
    active = [g not in (1, 3) for g in range(4) for _ in range(4)]
    _, buf = with_active(active)
    assert buf.completion_mask[~buf.active].sum() == 0 and torch.equal(buf.active, torch.tensor(active))
    for p in range(2):
        sched = buf.schedule(p, steps=2, micro_batch_size=2)  # 16 / 2 / 2 = 4 micro-batches per step, always
        assert [len(step) for step in sched] == [4, 4]
        trained = torch.cat([torch.cat(step) for step in sched]).tolist()
        assert sorted(trained) == [i for i in range(16) if active[i]]  # each kept sample once, no other
        # the kept samples in the pass's shuffled order, cut evenly into steps
        order = [i for s in old_rule_schedule(with_active([True] * 16)[0], p, 1, 16)[0] for i in s if active[i]]
        assert [sorted(torch.cat(step).tolist()) for step in sched] == [sorted(order[:4]), sorted(order[4:])]
    counts = buf.sequence_counts(buf.plan(2, 2, 2))
    assert counts.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    assert buf.token_counts(buf.plan(2, 2, 2)).sum(1).tolist() == [buf.completion_mask[buf.active].sum().item()] * 2


def test_a_micro_batch_left_empty_gets_one_masked_filler_sample():
    active = [i in (2, 9) for i in range(16)]  # two kept samples for 2 steps x 4 micro-batches
    _, buf = with_active(active)
    sched = buf.schedule(0, steps=2, micro_batch_size=2)
    assert [len(step) for step in sched] == [4, 4] and all(len(mb) == 1 for step in sched for mb in step)
    trained = [i for step in sched for mb in step for i in mb.tolist() if active[i]]
    fillers = [i for step in sched for mb in step for i in mb.tolist() if not active[i]]
    assert sorted(trained) == [2, 9] and len(fillers) == 6
    assert buf.micro_batch(torch.tensor(fillers))["completion_mask"].sum() == 0  # adds nothing to loss or counts
    assert buf.sequence_counts([sched]).tolist() == [[1.0, 1.0]]
    _, none = with_active([False] * 16)  # a rank whose groups were all left out still makes every call
    sched = none.schedule(0, 2, 2)
    assert [len(step) for step in sched] == [4, 4] and none.sequence_counts([sched]).sum() == 0
    assert none.token_counts([sched]).sum() == 0



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


def test_tool_results_are_attended_to_but_never_trained_or_counted():
    prompts, comps = [[5, 6], [7]], [[1, 2, 3, 4], [8, 9]]
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    tool = torch.tensor([[1.0, 0, 0, 1], [1, 1, 1, 1]])  # sample 0: tokens 1-2 are a tool's result
    buf = RolloutBuffer.build(prompts, comps, torch.ones(2), mask, pad_id=0, order_seed=0, tool_mask=tool)
    assert buf.attention_mask[:, 2:].tolist() == mask.long().tolist()  # the model reads the results
    assert buf.completion_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]  # and is not trained on them
    plan = buf.plan(1, 1, 2)
    assert buf.token_counts(plan).item() == 4  # the loss normalizer counts the model's tokens only
    mb = buf.micro_batch(plan[0][0][0])
    assert mb["attention_mask"].shape[1] == 2 + 4  # the micro-batch keeps the results' columns
