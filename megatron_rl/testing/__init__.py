"""Helpers for testing parallel code on CPU: a gloo worker pool and layout switching."""
