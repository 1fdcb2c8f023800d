"""The data side: conversations -> samples -> shards -> packed batches (one module per stage)."""
