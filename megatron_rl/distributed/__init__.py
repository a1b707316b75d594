"""Process groups (NCCL/gloo), Megatron parallel_state, the local launcher and failure handling."""
