"""Which rank holds which tokens: the layouts (invertible token permutations, pure arithmetic),
end padding to a length a layout can split, and sharding a training batch (labels shifted over the
whole sequence first)."""
