"""Serve a recipe's model from vLLM on this machine, for a single-node run of a vLLM recipe.

    python tools/serve_vllm.py recipes/tiny-multi-turn-vllm.yaml [--servers N] [--dir DIR]
                               [--port-file F]

Writes a Hugging Face directory of the recipe's model shape (random weights: the trainer sends
its own at start-up) and starts ``--servers`` vLLM servers on 127.0.0.1 (default 1) as
``megatron-gspo launch`` does (weight transfer engine, one job key for all, development mode),
then prints what the trainer needs once every one answers:

    export MEGATRON_GSPO_VLLM_URLS=http://127.0.0.1:P1,... MEGATRON_GSPO_VLLM_KEY=...

(also written to ``--port-file``), and supervises them until interrupted: a server that exits
is started again on its port (with a backoff, at most 5 times in 10 minutes), and comes back
stale until the trainer's next sync; SIGTERM or SIGINT stops every server. Each server logs to
``DIR/server-<port>.log``. On a CPU the servers run in fp32 with eager execution; it needs
``vllm`` (``.ci/vllm-setup.sh`` on a CPU machine, ``megatron-gspo[gpu]`` on a GPU one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--servers", type=int, default=1, help="how many servers (default 1)")
    parser.add_argument("--dir", help="where to write the served model (default: a temp dir)")
    parser.add_argument("--port-file", help="also write the export line to this file")
    args = parser.parse_args()
    if args.servers < 1:
        parser.error("--servers must be >= 1")

    import torch

    from megatron_gspo.launch.supervisor import ServerSpec, Supervisor
    from megatron_gspo.rollout.vllm.http_client import wait_until_healthy
    from megatron_gspo.rollout.vllm.server_command import (
        RPC_DIR_ENV,
        new_job_key,
        on_ready_hook,
        server_backend,
        server_command,
        server_env,
        synced_dtype,
    )
    from megatron_gspo.rollout.vllm.single_node import cpu_serving_args, write_served_model
    from megatron_gspo.run.recipe import load_recipe
    from megatron_gspo.runtime.extras import require_extra
    from megatron_gspo.runtime.procs import free_port

    recipe = load_recipe(args.recipe)
    require_extra("vllm", "Serving the recipe's model from vLLM")
    work = Path(args.dir or tempfile.mkdtemp(prefix="gspo-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = write_served_model(work / "model", recipe.model)
    gpu = torch.cuda.is_available()
    extra = ["--seed", "0"]
    if gpu:
        extra += ["--max-model-len", str(recipe.model.max_seq_length)]
        extra += ["--dtype", synced_dtype(recipe)]
    else:
        extra += cpu_serving_args(
            recipe.model.max_seq_length, max_num_seqs=256, mla=recipe.model.mla is not None
        )
    backend = server_backend(recipe.rollout.vllm.weight_sync, gpu=gpu)
    key = new_job_key()
    env = {**server_env(key), "VLLM_CPU_KVCACHE_SPACE": "2"}
    specs = []
    for _ in range(args.servers):
        port = free_port()
        cmd = server_command(
            str(model_dir), host="127.0.0.1", port=port, extra_args=extra, weight_transfer=backend
        )
        log = work / f"server-{port}.log"
        spec = ServerSpec(
            cmd, env, f"http://127.0.0.1:{port}", log=log, on_ready=on_ready_hook(),
            scratch_env=RPC_DIR_ENV,
        )  # fmt: skip
        specs.append(spec)
    urls = [s.url for s in specs]

    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} serve_vllm: {line}", flush=True)

    supervisor = Supervisor(specs, log=say)

    def announce() -> None:
        try:
            wait_until_healthy(urls, timeout_s=900, interval_s=1)
        except Exception as e:  # noqa: BLE001 - the servers' logs say why
            say(f"not every server became healthy: {e}")
            supervisor.stop("a server did not become healthy")
            return
        line = f"export MEGATRON_GSPO_VLLM_URLS={','.join(urls)} MEGATRON_GSPO_VLLM_KEY={key}\n"
        print(line, end="", flush=True)
        if args.port_file:
            tmp = Path(args.port_file).with_suffix(".tmp")
            tmp.write_text(line)
            tmp.replace(args.port_file)  # whoever waits for the file reads it whole

    threading.Thread(target=announce, name="announce", daemon=True).start()
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
