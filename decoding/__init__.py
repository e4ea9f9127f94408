"""The lossless speculative decoding engine every stage runs: rejection sampling, the batched KV
cache with holes, and the propose-verify-accept loop over any Draft."""
