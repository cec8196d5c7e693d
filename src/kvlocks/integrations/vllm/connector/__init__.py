"""The KV connector that continues a compacted prefix from a ``kvlocks compact`` file.

:mod:`.kv_connector` is the connector vLLM loads by module path
(``"kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector"``);
:mod:`.compacted` reads the file's header and builds requests (no vLLM import); :mod:`.rope`
re-rotates the kept keys; :mod:`.http` refuses a bad request in vLLM's OpenAI server.
Importing this package imports nothing from vLLM.
"""
