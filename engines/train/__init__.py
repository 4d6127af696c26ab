"""engines/train."""
