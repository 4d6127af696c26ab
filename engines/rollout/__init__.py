"""engines/rollout."""
