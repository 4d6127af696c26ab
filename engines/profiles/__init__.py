"""engines/profiles."""
