"""Generation on its own ranks (`generation_ranks: N`): the last N ranks of a launch generate, the others train.

Each side gets its own default process group, built on the launcher's store under a prefix, so DeepSpeed,
checkpoints and the loop's all-reduces see the trainers only, exactly as in a launch of that many ranks. The
two sides talk over two standalone gloo groups on the same store (their sockets on the interface the launcher's
address is on, as every group's):
- `p2p`, every rank: completions from a generator to each trainer it serves;
- `fanout`, trainer 0 and the generators: trainer 0's commands (generate rollout k, take new weights, stop)
  and the weight buckets that follow a weights command.
Messages are JSON and tensors, never pickles. Knows nothing of models.
"""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Which ranks of the launch train and which generate: generators are the last `generators` ranks, so a
    node-major launch puts them on the last node(s)."""
    rank: int  # in the launch
    world: int  # the launch's ranks
    generators: int

    @property
    def trainers(self) -> int:
        return self.world - self.generators

    @property
    def is_generator(self) -> bool:
        return self.rank >= self.trainers

    def generator_of(self, trainer: int) -> int:
        """The launch rank of the generator that serves `trainer` (trainers are dealt round-robin)."""
        return self.trainers + trainer % self.generators

    def served_by(self, generator: int) -> list[int]:
        return [t for t in range(self.trainers) if self.generator_of(t) == generator]


def layout(generation_ranks: int) -> Layout:
    return Layout(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), generation_ranks)


def role_env(lay: Layout) -> dict[str, str]:
    """The environment a side's code sees: its own rank and world (DeepSpeed and torch read them)."""
    if lay.is_generator:
        return {"RANK": str(lay.rank - lay.trainers), "WORLD_SIZE": str(lay.generators)}
    return {"RANK": str(lay.rank), "WORLD_SIZE": str(lay.trainers)}


def launch_store(timeout_s: float):
    """A client of the launcher's rendezvous store (local.sh, the Slurm script and torchrun all host one on
    MASTER_ADDR:MASTER_PORT)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


TRAINER_KEY = "grpo/link/trainer/{}"  # set by each trainer on its way to the link


def trainer_arrived(store, rank: int) -> None:
    store.set(TRAINER_KEY.format(rank), "1")


def wait_for_trainers(store, lay: Layout, timeout_s: float, stopped) -> bool:
    """A generation rank's wait for every trainer to reach the link, a second at a time so that `stopped()` (a
    stop signal: trainers that got one during start-up exit 75 without coming) is heard; True once they all
    came, False when stopped first. Trainers that never come: a LaunchError after `timeout_s`."""
    from grpo_recipe.dist.env import LaunchError

    keys, deadline = [TRAINER_KEY.format(t) for t in range(lay.trainers)], time.monotonic() + timeout_s
    while not stopped():
        try:
            store.wait(keys, datetime.timedelta(seconds=1))
            return True
        except RuntimeError:  # not yet (torch's DistStoreError on a wait's timeout)
            if time.monotonic() > deadline:
                raise LaunchError(f"generation rank {lay.rank}: the {lay.trainers} training ranks did not reach "
                                  f"the link within collective_timeout_s = {timeout_s:g} s") from None
    return False


class Link:
    """The groups between trainers and generators, and the messages over them."""

    def __init__(self, store, lay: Layout, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.lay = lay
        self.p2p = dist.ProcessGroupGloo(dist.PrefixStore("grpo/link/p2p/", store), lay.rank, lay.world, timeout)
        self.fanout = None
        if lay.rank == 0 or lay.is_generator:  # fanout rank: 0 for trainer 0, 1 + i for generator i
            rank = 0 if lay.rank == 0 else 1 + lay.rank - lay.trainers
            self.fanout = dist.ProcessGroupGloo(dist.PrefixStore("grpo/link/fanout/", store), rank,
                                                1 + lay.generators, timeout)
        self._sending: list = []  # p2p sends in flight (their tensors must live until they complete)

    # -- fanout: trainer 0 to every generator --------------------------------------------------
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a CPU tensor: the link is gloo's) from trainer 0 to every generator, in place."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.fanout.broadcast([tensor], opts).wait()
        return tensor

    def broadcast_json(self, message: dict | None = None) -> dict:
        """Trainer 0 passes `message`; each generator gets it back."""
        payload = _encode(message) if message is not None else None
        size = self.broadcast(torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64))
        payload = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        return _decode(self.broadcast(payload))

    # -- p2p: a generator to one trainer --------------------------------------------------------
    def send(self, dst: int, message: dict, tensors: list[torch.Tensor]) -> None:
        """Without waiting for `dst` to receive (it may be busy in its own collectives): the sends complete
        while the generator goes on; `flush` waits for them."""
        header = _encode({**message, "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")]
                                                 for t in tensors]})
        # gloo: CPU tensors only (a generator's log-probs may come from its GPU)
        parts = [torch.tensor([header.numel()], dtype=torch.int64), header,
                 *[t.detach().cpu().contiguous() for t in tensors]]
        for tag, part in enumerate(parts):
            self._sending.append((self.p2p.send([part], dst, tag), part))

    def recv(self, src: int) -> tuple[dict, list[torch.Tensor]]:
        size = torch.empty(1, dtype=torch.int64)
        self.p2p.recv([size], src, 0).wait()
        header = torch.empty(int(size.item()), dtype=torch.uint8)
        self.p2p.recv([header], src, 1).wait()
        message = _decode(header)
        tensors = []
        for tag, (shape, dtype) in enumerate(message.pop("tensors"), start=2):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self.p2p.recv([t], src, tag).wait()
            tensors.append(t)
        return message, tensors

    def flush(self) -> None:
        """Wait for every send in flight."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()


def _encode(message: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)


def _decode(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.numpy()).decode())


_current: list[Link] = []


def connect(lay: Layout, timeout_s: float, store=None) -> Link:
    """This process's link (every rank of the launch makes its own, together); `store`: the launcher's, when
    this process already holds it."""
    from grpo_recipe.dist import rendezvous

    # gloo listens on the interface of the launcher's address (loopback on one node), as the training group does
    os.environ.update(rendezvous.backend_env(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    _current[:] = [Link(store if store is not None else launch_store(timeout_s), lay, timeout_s)]
    return _current[0]


def current() -> Link:
    if not _current:
        raise RuntimeError("generation_ranks: the link between trainers and generators is not up "
                           "(init_distributed(generation_ranks=N) makes it)")
    return _current[0]
