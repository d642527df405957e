"""KV memory: the plan made at start (kv_plan), the pool's pages, promises and leases (kv_pool),
the layout pages store (kv_dtype), and the prompt store over them (prompt_radix, prompt_share,
host_tier)."""
