"""The fidelity lab: the LOCKS chain of evidence measured on real activations.

page-local spectral concentration -> token-logit fidelity -> log-sum-exp ranking fidelity ->
carrier survival, for LOCKS and the selectors it is compared with ("LOCKS: Page-Local Compact Key
Summaries for Efficient Long-Context Decoding", arXiv 2607.24555, §3, §5, §6). Modules, one concept each:

- :mod:`.prompts` needle / prose / calibration prompts; :mod:`.capture` activations as safetensors;
- :mod:`.exact` one layer's data and dense reference; :mod:`.variants` the selectors measured;
- :mod:`.metrics` coverage, carriers, score errors, rank correlation; :mod:`.bounds` Eq. 6-9;
- :mod:`.scopes` and :mod:`.ladder` the scope ladder; :mod:`.tails` quantization tails;
  :mod:`.adaptive` int4/int8 basis chosen per page by key-norm range;
- :mod:`.measure` one layer; :mod:`.runner` a run; :mod:`.summary` and :mod:`.plots` its files.

Run it with ``kvlocks fidelity --out DIR`` (see ``docs/fidelity.md``).
"""

from kvlocks_lab.fidelity.capture import ActivationCapture, capture_prompt, load_capture, save_capture
from kvlocks_lab.fidelity.config import FidelityConfig
from kvlocks_lab.fidelity.runner import run_fidelity

__all__ = ["ActivationCapture", "FidelityConfig", "capture_prompt", "load_capture", "run_fidelity", "save_capture"]
