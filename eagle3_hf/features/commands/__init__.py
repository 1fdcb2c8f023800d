"""The feature commands (serve-features, serve-vllm): they import the table and the core, never a route directly."""
