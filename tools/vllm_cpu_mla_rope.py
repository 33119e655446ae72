"""Does this vLLM's CPU rotary kernel still misread multi-latent attention's layout?

    python tools/vllm_cpu_mla_rope.py

Rotates the RoPE part of a ``[tokens, heads, qk_nope + qk_rope]`` query (a view, as vLLM's
``MultiHeadLatentAttentionWrapper`` passes it) and a ``[tokens, 1, qk_rope]`` key sliced out of
the latent projection, with vLLM's CPU kernel (``RotaryEmbedding.forward_cpu``) and with vLLM's
own PyTorch implementation (``forward_native``), and prints the largest difference of each.
vllm-cpu 0.32.0 printed about 6 for the query and 4 for the key (the kernel rotates head ``h``
of token ``t`` by the position of token ``t * heads + h``); a fixed kernel prints 0, and then
``megatron_gspo/rollout/vllm/server_side/cpu_rope.py`` may go. A flat
``[tokens, heads * qk_rope]`` query (every other attention) is printed as the control.
"""

import torch


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    tokens, heads, nope, rope, latent = 8, 4, 128, 64, 512
    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(
            rope,
            max_position=64,
            is_neox_style=False,  # DeepSeek's interleaved pairs, as vLLM's deepseek_v2.py
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    q_proj = torch.randn(tokens, heads * (nope + rope), generator=g)
    kv_proj = torch.randn(tokens, latent + rope, generator=g)

    def mla(q, kv):  # views into the projections' outputs, as vLLM makes them
        return q.view(tokens, heads, nope + rope)[..., nope:], kv[:, latent:].unsqueeze(1)

    def flat(q, kv):
        q, k = mla(q, kv)
        return q.reshape(tokens, heads * rope), k.reshape(tokens, rope)

    for name, layout in (("MLA (3-D views)", mla), ("flat (2-D)", flat)):
        ref_q, ref_k = rotary.forward_native(positions, *layout(q_proj.clone(), kv_proj.clone()))
        out_q, out_k = rotary.forward_cpu(positions, *layout(q_proj.clone(), kv_proj.clone()))
        dq = (out_q.reshape(ref_q.shape) - ref_q).abs().max().item()
        dk = (out_k.reshape(ref_k.shape) - ref_k).abs().max().item()
        print(f"{name:16s} max |kernel - native|: query {dq:.3g}, key {dk:.3g}")


if __name__ == "__main__":
    main()
