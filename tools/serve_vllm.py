"""Serve a recipe's model from vLLM on this machine, for a single-node run of a vLLM recipe.

    python tools/serve_vllm.py recipes/tiny-multi-turn-vllm.yaml [--dir DIR] [--port-file F]

Writes a Hugging Face directory of the recipe's model shape (random weights: the trainer sends
its own at start-up) and starts a vLLM server on 127.0.0.1 as ``megatron-gspo launch`` does
(weight transfer engine, job key, development mode), then prints what the trainer needs:

    export MEGATRON_GSPO_VLLM_URLS=http://127.0.0.1:PORT MEGATRON_GSPO_VLLM_KEY=...

and serves until interrupted. On a CPU the server runs in fp32 with eager execution; it needs
``vllm`` (``.ci/vllm-setup.sh`` on a CPU machine, ``megatron-gspo[gpu]`` on a GPU one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--dir", help="where to write the served model (default: a temp dir)")
    parser.add_argument("--port-file", help="also write the two export lines to this file")
    args = parser.parse_args()

    import torch

    from megatron_gspo.rollout.vllm.local_server import (
        cpu_serving_args,
        served,
        write_served_model,
    )
    from megatron_gspo.run.recipe import load_recipe
    from megatron_gspo.runtime.extras import require_extra

    recipe = load_recipe(args.recipe)
    require_extra("vllm", "Serving the recipe's model from vLLM")
    work = Path(args.dir or tempfile.mkdtemp(prefix="gspo-vllm-"))
    model_dir = write_served_model(work / "model", recipe.model)
    extra = ["--seed", "0"]
    if torch.cuda.is_available():
        extra += ["--max-model-len", str(recipe.model.max_seq_length)]
    else:
        extra += cpu_serving_args(
            recipe.model.max_seq_length, max_num_seqs=256, mla=recipe.model.mla is not None
        )
    from megatron_gspo.rollout.vllm.server import server_backend, synced_dtype

    gpu = torch.cuda.is_available()
    if gpu:
        extra += ["--dtype", synced_dtype(recipe)]
    backend = server_backend(recipe.rollout.vllm.weight_sync, gpu=gpu)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    with served(model_dir, extra, env=env, weight_transfer=backend) as (url, key):
        lines = f"export MEGATRON_GSPO_VLLM_URLS={url} MEGATRON_GSPO_VLLM_KEY={key}\n"
        print(lines, end="", flush=True)
        if args.port_file:
            Path(args.port_file).write_text(lines)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
