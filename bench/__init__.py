"""Side-by-side benchmarks against named peers; each writes JSON with ratios measured in one run."""
