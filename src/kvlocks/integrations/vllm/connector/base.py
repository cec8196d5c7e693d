"""vLLM's v1 KV connector base classes, and what kvlocks' connectors share on top of them (kvlocks'
own connector, :mod:`kvlocks.integrations.vllm.connector.kv_connector`, and the benchmark's
random-prefix connector in the lab)."""

from __future__ import annotations

from kvlocks.integrations.vllm.compat import TESTED_VLLM_VERSIONS, VllmCompatError, vllm_version


def connector_base_classes():
    """``(KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)`` of this vLLM, or a loud error."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            KVConnectorMetadata,
            KVConnectorRole,
        )
    except ImportError as exc:
        raise VllmCompatError(
            f"vLLM {vllm_version()} has no v1 KV connector API "
            f"(vllm.distributed.kv_transfer.kv_connector.v1.base; tested: {TESTED_VLLM_VERSIONS}): {exc}"
        ) from exc
    return KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole


class SyncLoadOnly:
    """Mixin for a connector that loads synchronously in ``start_load_kv`` and never saves: vLLM's
    per-layer wait and save hooks as no-ops."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return


def transfer_results(finished_recving: set[str], failed_recving: set[str]):
    """What ``get_transfer_results`` returns: failed receives are also reported as finished, as the
    v1 API requires, so the scheduler can release them from their wait."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_recving=set(finished_recving) | set(failed_recving),
                                      failed_recving=set(failed_recving))
