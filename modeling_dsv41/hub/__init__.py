"""Checkpoints and the Hub: the released FP8/FP4 format (:mod:`.checkpoint_loading`, :mod:`.conversion`) and
remote-code export (:mod:`.export`)."""
