"""A tiny Qwen3-MoE model directory that ``vllm serve`` loads on a CPU, and a server to run it.

The directory is written by the test itself: ``config.json`` from our own
:class:`ModelConfig` (so the Megatron model and the served one are the same architecture),
random weights through transformers' ``save_pretrained``, and a word-level tokenizer trained
with the ``tokenizers`` library on a synthetic corpus so that every id of the vocabulary is a
token (vLLM detokenizes whatever the random model samples).

vLLM's CPU attention needs ``head_dim`` 64 (or another size its kernels support; 16 fails with
"Unsupported CPU attention configuration"); its CPU multi-latent attention needs a
``kv_lora_rank + qk_rope_head_dim`` latent of 576 (512 + 64, DeepSeek-V3's own; smaller ones
fail with "Head dimension ... is not supported by MLA").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from megatron_gspo.config import MLAConfig, ModelConfig
from megatron_gspo.runtime.procs import free_port
from megatron_gspo.weights.hf import HFMapping

# Tiny but not degenerate: 2 layers, GQA (4 query heads, 2 KV groups: TP=2 splits them),
# 4 experts top-2.
VLLM_TINY_MOE = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=64,
    vocab_size=256,
    max_seq_length=128,
    num_experts=4,
    moe_ffn_hidden_size=32,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.0,
    rotary_base=10000,
)
# The same without experts.
VLLM_TINY_DENSE = VLLM_TINY_MOE.model_copy(
    update=dict(num_experts=None, moe_ffn_hidden_size=None, ffn_hidden_size=96)
)
# The DeepSeek-V3 family: multi-latent attention with DeepSeek-V3's head and latent sizes, a
# dense first layer, then an MoE layer with a shared expert and sigmoid routing whose choice
# depends on the expert bias and on the groups (8 experts in 4 groups, the best 2, top-4).
VLLM_TINY_DEEPSEEK = VLLM_TINY_MOE.model_copy(
    update=dict(
        num_query_groups=4,
        head_dim=192,
        mla=MLAConfig(
            q_lora_rank=32,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        ffn_hidden_size=96,
        dense_layers=[0],
        num_experts=8,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=32,
    )
)
EOS_ID = 1


def random_full_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full Megatron tensors far from initialization, so the model has clear preferences.

    Norm weights around 1, a sharp router (top-2 choices differ between tokens) and matrices
    scaled by 1/sqrt(fan_in) with larger output logits, so greedy choices have a wide margin.
    """
    g = torch.Generator().manual_seed(seed)
    full = {}
    for name, shape in HFMapping(cfg).megatron_shapes.items():
        if len(shape) == 1:
            t = 1 + 0.3 * torch.randn(shape, generator=g)
        elif name.endswith("router.weight"):
            t = torch.randn(shape, generator=g)
        elif name == "output_layer.weight":
            t = 3 * torch.randn(shape, generator=g) / shape[-1] ** 0.5
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        full[name] = t
    return full


def train_tokenizer(vocab_size: int):
    """A word-level tokenizer whose vocabulary is exactly ``vocab_size`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<eos>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=specials)
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    tok.train_from_iterator([" ".join(words)] * 2, trainer=trainer)
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<eos>") == EOS_ID
    return tok


def write_tiny_model(path: Path, cfg: ModelConfig = VLLM_TINY_MOE, seed: int = 0) -> Path:
    """Write a Qwen3(-MoE) or DeepSeek-V3 HF directory: ``config.json`` as the project
    exports it, weights from :func:`random_full_state_dict`."""
    import transformers
    from transformers import PreTrainedTokenizerFast

    from megatron_gspo.model.hf_config import hf_config_from_model_config

    hf_cfg = hf_config_from_model_config(cfg)
    arch = hf_cfg.pop("architectures")[0]
    hf_cfg.pop("model_type")
    hf_cfg["eos_token_id"] = EOS_ID
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(config_cls(**hf_cfg)).float().eval()
    mapping = HFMapping(cfg)
    hf = dict(mapping.iter_hf(random_full_state_dict(cfg, seed).items()))
    # transformers 5 keeps experts fused in memory: [E, 2I, H] gate_up and [E, H, I] down.
    state = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            state[name] = torch.stack(
                [
                    torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]])
                    for e in range(cfg.num_experts)
                ]
            )
        elif name.endswith("mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            state[name] = torch.stack(
                [hf[f"{p}{e}.down_proj.weight"] for e in range(cfg.num_experts)]
            )
        else:
            state[name] = hf[name]
    model.load_state_dict(state, strict=True)
    model.save_pretrained(path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(cfg.vocab_size), unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(path)
    return path


# The judge's chat template: the messages' texts one after another (the word-level vocabulary
# has no role markers).
JUDGE_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_reward_model(path: Path, seed: int = 0) -> Path:
    """A tiny scalar reward model (Qwen3 with a one-label classification head, as
    transformers' ``Qwen3ForSequenceClassification``), random weights of a clear scale, with
    the word-level tokenizer of :func:`train_tokenizer`."""
    return _write_dense_qwen3(path, seed, "Qwen3ForSequenceClassification", num_labels=1)


def write_judge_model(path: Path, seed: int = 0) -> Path:
    """A tiny dense Qwen3 chat model for a served judge: random weights of a clear scale, the
    word-level tokenizer and :data:`JUDGE_CHAT_TEMPLATE`."""
    return _write_dense_qwen3(path, seed, "Qwen3ForCausalLM")


def _write_dense_qwen3(path: Path, seed: int, arch: str, **extra) -> Path:
    import transformers
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
        eos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False, dtype="float32",
        **extra,
    )  # fmt: skip
    model = getattr(transformers, arch)(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(256), unk_token="<unk>", eos_token="<eos>",
        pad_token="<eos>", chat_template=JUDGE_CHAT_TEMPLATE,
    )  # fmt: skip
    fast.save_pretrained(path)
    return path


class VLLMServer:
    """A vLLM server as this project starts them (:mod:`megatron_gspo.rollout.vllm.server_command`:
    weight transfer engine, job-key middleware, dev mode), on 127.0.0.1, its output in a log
    file."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 128,
        env: dict[str, str] | None = None,
        weight_transfer: str = "gspo",
        extra_args: tuple[str, ...] = (),
        mla: bool = False,
    ) -> None:
        """``env``: more of the server's environment; ``weight_transfer``: the backend of
        vLLM's RL API the trainer syncs through; ``extra_args``: more of vLLM's options;
        ``mla``: the model has multi-latent attention (``single_node.CPU_MLA_ARGS``)."""
        self.weight_transfer = weight_transfer
        from megatron_gspo.rollout.vllm.server_command import (
            RPC_DIR_ENV,
            new_job_key,
            server_command,
            server_env,
        )

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.key = new_job_key()
        env = {**server_env(self.key), **(env or {})}
        # GiB of KV cache on the CPU backend; the default asks for far more than a test needs.
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self._rpc_dir = tempfile.mkdtemp(prefix="gspo-server-")  # removed in stop()
        env[RPC_DIR_ENV] = self._rpc_dir
        extra = ["--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len)]
        # A budget that never splits a prefill (see single_node.cpu_serving_args).
        extra += ["--max-num-seqs", "64", "--seed", "0"]
        extra += ["--max-num-batched-tokens", str(64 * max_model_len), *extra_args]
        if mla:
            from megatron_gspo.rollout.vllm.single_node import CPU_MLA_ARGS

            extra += CPU_MLA_ARGS
        cmd = server_command(
            str(model_dir),
            host="127.0.0.1",
            port=self.port,
            extra_args=extra,
            weight_transfer=weight_transfer,
        )
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log_tail(self, n: int = 80) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM to the whole session at once: the API server alone takes tens of
            # seconds to wind its engine down (its "EngineDeadError" in the log is this).
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Whatever of its session is left (it started them all in its own session).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
