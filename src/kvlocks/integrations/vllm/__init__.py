"""vLLM integration: a general plugin registering a LOCKS attention backend (CUDA and CPU), see docs/vllm.md.

Importing this package imports nothing from vLLM and changes nothing; :func:`enable` (or the
``KVLOCKS_VLLM_CONFIG`` environment variable read by the ``vllm.general_plugins`` entry point)
switches LOCKS decode on for engines started afterwards.
"""

from kvlocks.integrations.vllm.plugin import ENV_VAR, current_config, enable, register
from kvlocks.integrations.vllm.store import summary_bytes_per_token

__all__ = ["ENV_VAR", "current_config", "enable", "register", "summary_bytes_per_token"]
