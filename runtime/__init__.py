"""S4 KV vLLM plugin and command line."""
