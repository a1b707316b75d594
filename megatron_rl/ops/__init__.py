"""Math on sharded tensors: context-parallel attention, zigzag layout, vocab-parallel log-probs."""
