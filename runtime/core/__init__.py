"""Host-side engine core: scheduler, block manager, sequences, buckets, request parameters. No jax here."""
