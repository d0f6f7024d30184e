"""The one place the chat package touches the tokenizer adapter and the aligner.

Those modules move (issue 11: ``pipelines/tokenizers/``, ``pipelines/align/``); when they do,
only the two import lines below change.
"""

from pipelines.alignment import align_flat
from pipelines.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "align_flat", "load_tokenizer"]
