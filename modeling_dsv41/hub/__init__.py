"""Publishing on the Hub: remote-code export with a model card (:mod:`.export`), and the registration of our quantizer
with transformers that tolerates the remote copy of the code (:mod:`.registration`)."""
