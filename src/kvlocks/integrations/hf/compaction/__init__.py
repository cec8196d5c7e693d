"""Compaction with a Hugging Face model: reference-query capture (:mod:`.capture`, :mod:`.passes`),
whole-model compaction (:mod:`.model`: ``compact_prefix``) and serving a compacted prefix (:mod:`.serve`)."""
