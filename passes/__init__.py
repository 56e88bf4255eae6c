"""Graph -> Graph rewrites, one per file, run in order by `passes.pipeline`."""
