"""The memory planner: per-GPU memory by component, and layouts that fit."""
