"""dist/collectives.py: the one owner of the recipe's collectives and of their tensors' device."""
import ast
import json
import subprocess
import sys
import torch

from conftest import REPO, torchrun
from grpo_recipe.dist.collectives import FORCE_ENV, backend_device
from grpo_recipe.dist.env import rank_env
from grpo_recipe.dist.group import backend_name

# torch.distributed's (and DeepSpeed's comm's) functions that talk to other ranks
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
               "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
               "recv_object_list", "all_reduce_coalesced", "inference_all_reduce"}
DIST_MODULES = ("torch.distributed", "deepspeed.comm")


def direct_collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every torch.distributed / deepspeed.comm collective that `source` calls or imports."""
    tree = ast.parse(source)
    aliases = set()  # local names bound to torch.distributed or deepspeed.comm
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in DIST_MODULES:
                    aliases.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    found.append((node.lineno, a.name))

    def dotted(expr) -> str:
        return f"{dotted(expr.value)}.{expr.attr}" if isinstance(expr, ast.Attribute) else \
            expr.id if isinstance(expr, ast.Name) else ""

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = dotted(node.value)
            if base in aliases or base in DIST_MODULES:
                found.append((node.lineno, f"{base}.{node.attr}"))
    return found


def test_the_scan_finds_every_spelling_of_a_direct_collective():
    src = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as td\n"
           "from torch.distributed import barrier\nimport deepspeed.comm as dc\n"
           "dist.all_reduce(x)\ntd.broadcast_object_list(b)\ntorch.distributed.all_gather_object(p, o)\n"
           "dc.all_reduce(x)\ndist.get_rank()\nmine.all_reduce(x)\n")
    assert sorted(n for _, n in direct_collective_calls(src)) == sorted([
        "barrier", "dist.all_reduce", "td.broadcast_object_list", "torch.distributed.all_gather_object",
        "dc.all_reduce"])


def test_no_module_outside_dist_calls_a_collective_directly():
    """Every collective goes through grpo_recipe/dist/, which decides where its tensors live (NCCL: CUDA only)."""
    offenders = []
    for path in sorted((REPO / "grpo_recipe").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[1] == "dist":
            continue
        offenders += [f"{rel}:{line} {name}" for line, name in direct_collective_calls(path.read_text())]
    assert offenders == [], "call grpo_recipe.dist.collectives instead:\n" + "\n".join(offenders)


def test_collective_tensors_go_to_the_gpu_where_nccl_serves_them():
    gpu = torch.device("cuda", 3)
    assert backend_device("nccl", gpu) == gpu
    assert backend_device("cpu:gloo,cuda:nccl", gpu) == gpu
    assert backend_device("gloo", gpu) == torch.device("cpu")  # a CPU-only group on a GPU machine
    assert backend_device("gloo", torch.device("cpu")) == torch.device("cpu")


def test_nccl_timeouts_reach_python_so_the_silent_rank_is_named():
    """Watchdog mode 2 aborts the communicators without ending the process: the next collective raises, and
    liveness (which recognises NCCL's errors) prints its one line instead of an abort's exit 134."""
    from grpo_recipe.dist.group import NCCL_ENV
    from grpo_recipe.dist.liveness import is_collective_failure

    assert NCCL_ENV == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert is_collective_failure(RuntimeError("NCCL communicator was aborted on rank 1"))
    assert is_collective_failure(torch.distributed.DistBackendError("Watchdog caught collective operation timeout"))


def test_a_gpu_process_group_takes_cpu_tensors_too():
    """On CUDA the group has gloo for CPU tensors beside NCCL (a stray CPU tensor must not crash NCCL)."""
    assert backend_name(cuda=True) == "cpu:gloo,cuda:nccl"
    assert backend_name(cuda=False) == "gloo"


def expected(world: int) -> dict:
    return {"sum": [sum(1.0 + r for r in range(world)), sum(10.0 * r for r in range(world))],
            "max": [float(world), 10.0 * (world - 1)], "min": [1.0, 0.0], "input_kept": True,
            "named_a": float(sum(range(world))), "named_b": [[float(world)] * 2] * 2, "named_b_dtype": "torch.float64",
            "any_last": True, "every_last": world == 1, "every_true": True, "any_false": False,
            "no_error": None, "error": [world - 1, f"bad {world - 1}"], "broadcast": {"from": 0},
            "gathered": [2 * r for r in range(world)], "collective_device": "cpu",
            "values": [float(10 * r + i) for r in range(world) for i in range(r + 1)]}


def test_helpers_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "c.json"
    torchrun(2, ["tests/dist_collectives.py", str(out)])
    for got in json.loads(out.read_text()):
        assert got.pop("active") is True
        assert got == expected(2)


def test_forced_collectives_run_at_a_world_of_one(tmp_path):
    """GRPO_FORCE_COLLECTIVES=1 (the GPU check): a single process runs every collective, same results."""
    out = tmp_path / "c.json"
    env = rank_env(**{FORCE_ENV: "1"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    subprocess.run([sys.executable, "tests/dist_collectives.py", str(out)], cwd=REPO, env=env, check=True,
                   timeout=300)
    (got,) = json.loads(out.read_text())
    assert got.pop("active") is True
    assert got == expected(1)
