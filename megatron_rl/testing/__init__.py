"""Helpers for testing parallel code on CPU: a gloo worker pool, layout switching, and the training
step that layouts are compared with one process on (``megatron-rl check-layouts`` runs it too)."""
