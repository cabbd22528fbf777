"""What decoding needs beyond the model's forward: the decode caches (:mod:`.cache`) and DSpark speculative
decoding (:mod:`.speculative`). Imports go one way: the model imports this package, never the reverse."""
