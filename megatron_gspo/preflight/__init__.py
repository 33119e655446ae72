"""``megatron-gspo preflight``: is this node ready for a job? Versions, Transformer Engine and
FP8, vLLM, NCCL, the device's ceilings, the loss layer, one GSPO step of a Qwen3-30B-A3B-shaped
slice and the embedded engine, measured in one run (:mod:`megatron_gspo.preflight.run`)."""
