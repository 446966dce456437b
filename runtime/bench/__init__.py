"""`s4kv bench`: end-to-end throughput of each KV format through vLLM, one engine per configuration."""
