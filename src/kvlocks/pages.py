"""Page arithmetic, written once: how many pages a number of tokens takes.

Host code: ints, or integer tensors element-wise (no host sync). Triton kernels use ``tl.cdiv``.
"""


def num_pages(tokens, page_size):
    """Pages that hold ``tokens`` tokens, the last one possibly partial: ``ceil(tokens / page_size)``."""
    return -(-tokens // page_size)


def full_pages(tokens, page_size):
    """Pages that ``tokens`` tokens fill completely: ``floor(tokens / page_size)``."""
    return tokens // page_size
