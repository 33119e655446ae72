"""GSPO (Group Sequence Policy Optimization) for Mixture-of-Experts models on Megatron-Core."""

__version__ = "0.1.0"
