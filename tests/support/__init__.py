"""Test-only infrastructure that must never ship with the trainer (it installs system packages)."""
