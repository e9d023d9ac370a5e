"""Megatron-compatible data: indexed datasets (.bin/.idx), tokenizers, GPT sampling and blending.

    from megajax.data import IndexedDataset
    ds = IndexedDataset("data/corpus_text_document")   # opens .bin/.idx, checks both
    len(ds), ds[0], ds.sequence_lengths, ds.document_indices

Preprocessing: `python -m megajax.data.preprocess --help`. The global-batch loader (which needs JAX) is
megajax.data.loader.
"""

from megajax.data.blended import BlendedDataset
from megajax.data.gpt_dataset import GPTDataset
from megajax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from megajax.data.tokenizers import get_tokenizer

__all__ = ["BlendedDataset", "DataError", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter", "get_tokenizer"]
