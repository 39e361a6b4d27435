"""Preflight's environment checks: hub names (cached, offline, unreachable, mistyped paths) and the output folder,
each a one-line ConfigError before any process group; nothing written by the checks themselves."""
import http.server
import os
import shutil
import threading

import pytest

from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.dist.env import free_port
from grpo_recipe.model.source import hub_unreachable, model_folder
from grpo_recipe.run.preflight import check_output_dir


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_dir):
    """A hub cache holding org/tiny (the built-in model's files), an unreachable hub, and this process's hub
    offline switch put back afterwards (preflight sets it when it uses the cache)."""
    import huggingface_hub.constants as constants

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as the environment now says (read at import)
    monkeypatch.chdir(tmp_path)
    return snap


def test_a_cached_hub_model_is_used_offline_when_the_hub_is_unreachable(hub, capsys):
    import huggingface_hub.constants as constants

    assert model_folder("org/tiny") == hub
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE  # transformers will not retry
    assert "is unreachable" in capsys.readouterr().err


def test_hub_names_that_cannot_load(hub, monkeypatch):
    with pytest.raises(ConfigError, match="model_name_or_path: org/other is neither a local folder nor in the hub "
                                          "cache .* is unreachable .*: download it first"):
        model_folder("org/other")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"offline mode is on \(HF_HUB_OFFLINE\)"):
        model_folder("org/other")
    assert model_folder("org/tiny") == hub  # offline and cached: fine
    with pytest.raises(ConfigError, match="model_name_or_path: no such folder: runs/a/final$"):
        model_folder("runs/a/final")  # two slashes: no hub name looks like that
    (hub.parents[3] / "runs").mkdir()
    with pytest.raises(ConfigError, match="model_name_or_path: no such folder: runs/finl \\(and no hub model"):
        model_folder("runs/finl")  # runs/ is a folder here: a mistyped path, not a hub name


def test_hub_probe_counts_any_http_answer():
    assert "refused" in hub_unreachable(f"http://127.0.0.1:{free_port()}").lower()
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert hub_unreachable(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()


def test_output_dir_must_be_a_folder_that_takes_files(tmp_path):
    check_output_dir(str(tmp_path / "a" / "b"))  # created later, by the run; its parent takes files
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []  # the probe left nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="output_dir: .*/f is a file, not a folder"):
        check_output_dir(str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="output_dir: cannot create .*/f/run: .*/f is a file"):
        check_output_dir(str(tmp_path / "f" / "run"))


def test_weight_count_reads_the_headers_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from grpo_recipe.model.source import weight_count

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert weight_count(tiny_model_dir) == sum(p.numel() for p in model.parameters())  # tied weights once


class FakeHub(http.server.BaseHTTPRequestHandler):
    """A hub that has org/real (a config.json of 2 bytes) and nothing else."""
    def do_HEAD(self):  # noqa: N802
        found = self.path.startswith("/org/real/resolve/main/config.json")
        self.send_response(200 if found else 404)
        if found:
            for k, v in {"ETag": '"e"', "X-Repo-Commit": "0" * 40, "Content-Length": "2"}.items():
                self.send_header(k, v)
        else:
            self.send_header("X-Error-Code", "RepoNotFound")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_name_the_reachable_hub_does_not_have_is_one_line(hub, monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    try:
        assert model_folder("org/real") is None  # on the hub: transformers downloads it
        with pytest.raises(ConfigError, match=r"model_name_or_path: org/mistyped is neither a local folder nor a "
                                              r"model on http://127\.0\.0\.1:\d+ \(a private one needs"):
            model_folder("org/mistyped")
        (hub.parents[3] / "runs").mkdir()
        with pytest.raises(ConfigError, match=r"no such folder: runs/finl \(and no hub model of that name exists"):
            model_folder("runs/finl")
    finally:
        server.shutdown()


def test_a_local_model_folder_needs_config_weights_and_tokenizer(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "final")
    assert model_folder("run/final").resolve() == tmp_path / "run" / "final"
    with pytest.raises(ConfigError, match=r"run is a run's output folder: did you mean run/final\?"):
        model_folder("run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty is not a model folder: it has no config.json and no weights "
                                          r"\(\*.safetensors, pytorch_model\*.bin\) and no tokenizer files"):
        model_folder("./empty")


def test_a_cpu_accelerator_on_a_gpu_rank_is_one_line_before_anything_starts():
    from grpo_recipe.run.preflight import check_accelerator

    check_accelerator(cuda=False, ds_accelerator="cpu")  # a CPU run
    check_accelerator(cuda=True, ds_accelerator=None)
    check_accelerator(cuda=True, ds_accelerator="cuda")
    with pytest.raises(ConfigError, match=r"DS_ACCELERATOR=cpu is set, but this rank has a GPU.*CUDA_VISIBLE_DEVICES="):
        check_accelerator(cuda=True, ds_accelerator="cpu")


def test_a_colocated_vllm_share_that_cannot_fit_is_refused_before_the_engine_is_built():
    from grpo_recipe.run.preflight import check_vllm_memory, training_shard_bytes

    gib = 2**30
    # 8B parameters, bf16, full fine-tune on 8 GPUs of 80 GiB: 2 + 4 + 4 + 8 = 18 bytes/param over 8 ranks = 16.8 GiB
    shard = training_shard_bytes(8 * 10**9, 8 * 10**9, 8, bf16=True, offload=False)
    assert abs(shard / gib - 16.76) < 0.01
    check_vllm_memory(0.5, 79 * gib, 80 * gib, shard, gpu=0)
    with pytest.raises(ConfigError, match=r"leaves 8\.0 GiB of GPU 3 for training, which keeps at least 16\.8 GiB"):
        check_vllm_memory(0.9, 79 * gib, 80 * gib, shard, gpu=3)
    with pytest.raises(ConfigError, match=r"0\.5 of GPU 1 is 40\.0 GiB, but only 30\.0 GiB of its 80\.0 GiB are free"):
        check_vllm_memory(0.5, 30 * gib, 80 * gib, shard, gpu=1)
    # an offloaded optimizer keeps only the weights' shard on the GPU
    assert training_shard_bytes(8 * 10**9, 8 * 10**9, 8, bf16=True, offload=True) == 2 * 10**9


def test_the_final_models_space_counts_more_than_its_weights(tmp_path, monkeypatch, tiny_model_dir):
    """Issue #60.2: 4 bytes x parameters left the tokenizer, config, headers and the run's own files out: a disk
    within that margin passed, and with save_steps: 0 the trained weights were lost at the very end."""
    from grpo_recipe.model.source import weight_count
    from grpo_recipe.run import preflight as pf

    params = weight_count(tiny_model_dir)
    others = sum(f.stat().st_size for f in tiny_model_dir.iterdir() if f.suffix != ".safetensors")
    cfg = Config(model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path / "out"), save_steps=0, max_steps=10)
    need = pf.final_model_bytes(tiny_model_dir, params, cfg)
    assert need >= 4 * params + 2 * others + (1 << 20) + 10 * (4 << 10)
    monkeypatch.setattr(pf, "free_space", lambda path: (4 * params + others + (1 << 20), 10**6))  # weights fit
    with pytest.raises(ConfigError, match="too little for the final model and the run's own files"):
        pf.check_disk_space(cfg, tiny_model_dir, {})
    monkeypatch.setattr(pf, "free_space", lambda path: (need, 10**6))
    pf.check_disk_space(cfg, tiny_model_dir, {})
