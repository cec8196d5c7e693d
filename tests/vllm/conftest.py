"""vLLM tests run only in the vLLM venv (scripts/test_vllm.sh); elsewhere nothing here is collected.

The check imports ``vllm.LLM``, not just ``vllm``: pytest puts ``tests/`` on ``sys.path`` for this
directory, where ``import vllm`` alone would find ``tests/vllm`` itself as a namespace package.
"""

try:  # a missing or broken vLLM install (e.g. mismatched torchvision) counts as absent
    from vllm import LLM  # noqa: F401
except Exception:  # noqa: BLE001
    collect_ignore_glob = ["*"]
