"""The KV connector continuing a compacted prefix: vLLM loads :mod:`.kv_connector` by module path."""
