"""Real data for Megatron's training loop: a corpus into its indexed format, and an example.

:mod:`.preprocess` turns JSONL into ``PREFIX.bin``/``PREFIX.idx`` as Megatron-LM's
``tools/preprocess_data.py`` does (same flags, same bytes), on megatron-core's
``IndexedDatasetBuilder`` and megatron's tokenizer classes. :mod:`.corpus` builds a
deterministic English corpus from the docstrings of the installed Python standard library and
:mod:`.tokenizer_training` trains small tokenizers on it, so a machine without network can train
on real text (:mod:`.example` puts the pieces together for ``prepare-data --example``).
"""
