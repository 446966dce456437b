"""`s4kv eval`: quality of each KV format against bf16 KV, through vLLM or the torch references."""
