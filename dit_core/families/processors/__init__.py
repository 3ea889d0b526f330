"""Attention processors of our own, one per family: the family's q/k/v projections, norms and
rotary embeddings as in diffusers, with the attention itself computed by ``attention.attend``."""
