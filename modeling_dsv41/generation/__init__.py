"""What decoding needs beyond the model's forward: the decode caches (:mod:`.cache`), DSpark speculative
decoding (:mod:`.speculative`) and the ``generate`` overrides the causal LM mixes in (:mod:`.generate`). Imports go
one way: the model imports this package, never the reverse."""
