"""``tilegym_mamba2.transformers``, the import path the README has always given, is the Hugging
Face patch itself (integrations/hf/patch.py): the same module object, so that patching or
reading its attributes here and there is one thing."""
import sys

from .integrations.hf import patch

sys.modules[__name__] = patch
