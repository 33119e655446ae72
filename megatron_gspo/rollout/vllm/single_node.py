"""Trainer side: vLLM servers on this machine for a recipe's model (single-node runs, tests,
benchmarks).

:func:`write_served_model` writes a Hugging Face directory of the model's shape with random
weights (the trainer replaces them with its own at start-up, through the weight sync) and a
word-level tokenizer whose vocabulary is exactly the model's (vLLM's completions need one even
when prompts are token ids; the trainer never reads its text). :func:`served` runs a server on
it as ``megatron-gspo launch`` starts them (weight transfer engine, job key, development mode).
``tools/serve_vllm.py RECIPE`` does both for a recipe whose ``rollout.engine`` is ``vllm``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.runtime.procs import free_port


def write_served_model(directory: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron_gspo.rollout.vllm.hf_export import write_hf_checkpoint
    from megatron_gspo.weights.hf import HFMapping

    g = torch.Generator().manual_seed(seed)
    tensors = (
        (name, torch.randn(shape, generator=g) * 0.02)
        for name, shape in HFMapping(cfg).hf_shapes.items()
    )
    write_hf_checkpoint(directory, cfg, tensors, dtype=torch.float32)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["<unk>", "<eos>"]
    trainer = trainers.WordLevelTrainer(vocab_size=cfg.vocab_size, special_tokens=specials)
    words = [f"w{i}" for i in range(cfg.vocab_size - len(specials))]
    tok.train_from_iterator([" ".join(words)] * 2, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", '
        '"eos_token": "<eos>"}\n'
    )
    return directory


# On a CPU with AMX tiles vLLM serves multi-latent attention with its AMX backend, which packs
# the weights for bf16, fp16 or int8 only and refuses fp32 at load ("expect weight to be
# bfloat16..."); the reference CPU backend takes fp32. Without AMX that is vLLM's choice anyway.
CPU_MLA_ARGS = ("--attention-backend", "CPU_MLA")


def cpu_serving_args(max_model_len: int, max_num_seqs: int, *, mla: bool = False) -> list[str]:
    """vLLM arguments for a CPU server: fp32, eager, and a token budget per scheduler step that
    holds every sequence whole. vLLM 0.32 rewinds a seeded request's generator when a chunked
    prefill discards its sampled token, and a CPU generator has no offset to rewind ("CPU
    Generator does not use offset": the engine dies); with a budget of ``max_num_seqs x
    max_model_len`` tokens no prefill is ever split. ``mla``: the model has multi-latent
    attention (:data:`CPU_MLA_ARGS`)."""
    return [
        "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_model_len * max_num_seqs),
        *(CPU_MLA_ARGS if mla else ()),
    ]  # fmt: skip


@contextlib.contextmanager
def served(
    model_dir: Path,
    extra_args: list[str],
    *,
    env: dict | None = None,
    cpu: int | None = None,
    weight_transfer: str | None = "gspo",
):
    """A vLLM server on ``model_dir`` as ``launch`` starts them; yields ``(url, key)``."""
    import os
    import shutil
    import subprocess
    import tempfile
    import time

    from megatron_gspo.rollout.vllm.http_client import wait_until_healthy
    from megatron_gspo.rollout.vllm.server_command import (
        RPC_DIR_ENV,
        new_job_key,
        on_ready_hook,
        server_command,
        server_env,
    )

    key, port = new_job_key(), free_port()
    url = f"http://127.0.0.1:{port}"
    rpc_dir = tempfile.mkdtemp(prefix="gspo-server-")
    full_env = {
        **server_env(key), "VLLM_CPU_KVCACHE_SPACE": "1", RPC_DIR_ENV: rpc_dir, **(env or {})
    }  # fmt: skip
    cmd = server_command(
        str(model_dir),
        host="127.0.0.1",
        port=port,
        extra_args=extra_args,
        weight_transfer=weight_transfer,
    )
    log_path = model_dir.parent / "server.log"
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None

    with open(log_path, "w") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            preexec_fn=pin,
        )  # fmt: skip
        try:
            t0 = time.perf_counter()
            try:
                wait_until_healthy([url], timeout_s=600, interval_s=1)
            except Exception as e:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"{e}\n--- {log_path} ---\n{tail}") from None
            print(f"server ready in {time.perf_counter() - t0:.0f} s ({url})")
            if (ready := on_ready_hook()) is not None:
                ready(server.pid)
            yield url, key
        finally:
            os.killpg(server.pid, 15)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
            shutil.rmtree(rpc_dir, ignore_errors=True)
